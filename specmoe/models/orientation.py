"""Which way round a CPU computes a projection of a few rows, x @ Wᵀ (W [out, in], as checkpoints store it):
`F.linear(x, W)`, or the same product the other way round, (W @ xᵀ)ᵀ ("weight-major").

Decoding multiplies big weights by few rows: 1 row per sequence in a plain step, γ + 1 in a verification, a few per
expert. Reading the weight is the cost, so k rows should cost about what 1 row costs. On some CPUs and BLAS builds
`F.linear` with 2-16 rows instead takes a path that costs about k times one row (an AMD EPYC with AVX2 and MKL:
4 rows of a 12288 × 4096 fp32 weight 42 ms, one row 9 ms), while the weight-major product of the same 4 rows takes
11 ms: speculation's verification then costs what the physics says it should. Elsewhere the two may be equal, or
`F.linear` faster, so nothing is assumed: `probe` times both on square weights of growing size (rows 2 to 32) and
finds the smallest weight from which the weight-major product is faster at every row count probed, at that size and
every larger one, then up to how many rows (64, 128, 256) it stays faster; it is measured once per CPU, torch build,
thread count and dtype and kept in the machine cache (`specmoe.machine_cache`). `prepare` (at load) puts it where
`use_weight_major` reads it per call.

Only models that are not `deterministic` use it: a deterministic model pads its rows to the row classes measured
for `F.linear` (`rowclasses`), a property of that kernel. One row always goes through `F.linear` (the two are the
same speed there, and plain decoding keeps its kernel)."""
from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

from specmoe import machine_cache

SIZES = (256, 512, 1024, 2048)  # square weights probed (numel = size²)
ROWS = (2, 4, 8, 32)  # the rows the threshold is decided on
MORE_ROWS = (64, 128, 256)  # then: up to which of these it still wins (many sequences' verification)
WIN = 0.9  # weight-major time / F.linear time at most this (median over rows) ...
NEVER_WORSE = 1.05  # ... and at no row count above this
# past ROWS, it keeps winning while within WIN at every size from the threshold on and at WIDE
WIDE = (8192, 256)  # a wide, short weight (an LM head's shape), where it stops winning first

_WINS: dict[tuple[torch.dtype, int], tuple[int, int] | None] = {}  # (min numel, max rows)


def _time(f, reps: int) -> float:
    f()
    t = time.perf_counter()
    for _ in range(reps):
        f()
    return (time.perf_counter() - t) / reps


def _ratio(w: torch.Tensor, m: int, g: torch.Generator, rounds: int) -> float:
    """Weight-major time / F.linear time for m rows by w: the median of `rounds` ratios, each of the two timed
    back to back (a busy machine slows both alike)."""
    n = w.shape[1]
    x = torch.randn(m, n, generator=g).to(w.dtype)
    reps = max(2, int(4e6 // (w.numel() * max(1, m // 16))))
    return statistics.median(_time(lambda: torch.mm(w, x.t()).t(), reps) / _time(lambda: F.linear(x, w), reps)
                             for _ in range(rounds))


def probe(dtype: torch.dtype = torch.float32, sizes=SIZES, rows=ROWS, more_rows=MORE_ROWS, rounds: int = 7) -> dict:
    """{"min_numel": the smallest weight (elements) from which the weight-major product wins at every row count of
    `rows` (None: never), "max_rows": the most rows it still wins at there, "ratio": {size: {rows: weight-major
    time / F.linear time}}} for `dtype` on this CPU."""
    g = torch.Generator().manual_seed(0)
    ratio: dict[str, dict[str, float]] = {}
    wins = []
    weights = {n: torch.randn(n, n, generator=g).to(dtype) for n in sizes}
    for n, w in weights.items():
        per = {str(m): _ratio(w, m, g, rounds) for m in rows}
        ratio[str(n)] = per
        wins.append(statistics.median(per.values()) <= WIN and max(per.values()) <= NEVER_WORSE)
    first = next((i for i in range(len(sizes)) if all(wins[i:])), None)
    if first is None:
        return {"min_numel": None, "max_rows": None, "ratio": ratio, "dtype": str(dtype)}
    max_rows = max(rows)
    weights = {str(n): weights[n] for n in sizes[first:]}
    weights[f"{WIDE[0]}x{WIDE[1]}"] = torch.randn(*WIDE, generator=g).to(dtype)  # an LM head's shape
    for m in more_rows:
        at = {k: _ratio(w, m, g, max(3, rounds // 2)) for k, w in weights.items()}
        for k, r in at.items():
            ratio.setdefault(k, {})[str(m)] = r
        if max(at.values()) > WIN:
            break
        max_rows = m
    return {"min_numel": sizes[first] ** 2, "max_rows": max_rows, "ratio": ratio, "dtype": str(dtype)}


def prepare(dtype: torch.dtype, device: torch.device | str) -> tuple[int, int] | None:
    """Measure (or read from the machine cache) where the weight-major product wins for `dtype` on this CPU, so that
    `use_weight_major` knows it: (smallest weight in elements, most rows), or None (other devices; never)."""
    if torch.device(device).type != "cpu":
        return None
    key = (dtype, torch.get_num_threads())
    if key not in _WINS:
        entry = machine_cache.cached(machine_cache.machine_key(f"projection orientation {dtype}"),
                                     lambda: probe(dtype), lambda e: "max_rows" in e)
        _WINS[key] = None if entry["min_numel"] is None else (entry["min_numel"], entry["max_rows"])
    return _WINS[key]


def use_weight_major(x: torch.Tensor, numel: int) -> bool:
    """Whether a projection of x's rows (2 or more) by a weight of `numel` elements is computed weight-major
    (known only after `prepare` for x's dtype and this thread count; CPU only)."""
    at = _WINS.get((x.dtype, torch.get_num_threads())) if x.device.type == "cpu" else None
    return at is not None and numel >= at[0] and x.numel() <= at[1] * x.shape[-1]


def weight_major(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """x [n, in] @ w [out, in]ᵀ (+ b [out]) computed as (w @ xᵀ)ᵀ → [n, out], contiguous."""
    y = torch.mm(w, x.t()) if b is None else torch.addmm(b[:, None], w, x.t())
    return y.t().contiguous()
