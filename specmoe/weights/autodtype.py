"""`dtype="auto"` on a CPU: compute in the checkpoint's half dtype only where this CPU's half-precision decode products
are not slower than fp32 activations over the same stored weights (many CPUs without AVX512-BF16 / AMX run bf16
matmuls several times slower).

The answer comes from a short micro-benchmark at decode shapes: 1, 4 and 16 rows times a [2048, 1024] weight stored
in the half dtype, computed with fp32 activations (the native kernels reading the stored weight where they run, else
`F.linear` on its fp32 copy) and with half activations (`F.linear`), best of a few runs each, summed over the row
counts. It is cached per machine in `<cache dir>/machine.json`, keyed by CPU model, torch version, dtype, kernel
path and thread count, so it is measured once (`specmoe.machine_cache`).
"""
from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from specmoe import kernels as native
from specmoe import machine_cache

ROWS = (1, 4, 16)  # decode: one token, a verification's few, a batch
WEIGHT = (2048, 1024)  # out x in: a decode-sized projection
REPEATS = 5


def machine_key(dtype: torch.dtype) -> str:
    return machine_cache.machine_key(f"{str(dtype).replace('torch.', '')} decode via {native.path()}")


def _best(fn) -> float:
    fn()  # warm up
    best = float("inf")
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(dtype: torch.dtype) -> dict:
    """Seconds (summed over ROWS, best of REPEATS each) of the decode products with fp32 activations ("float32_s")
    and with `dtype` activations ("half_s") over a WEIGHT stored in `dtype` (CPU)."""
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(*WEIGHT, generator=g) * 0.05).to(dtype)
    w32 = None if native.available() else w.float()
    out = {"float32_s": 0.0, "half_s": 0.0, "rows": list(ROWS), "kernels": native.path()}
    for r in ROWS:
        x = torch.randn(r, WEIGHT[1], generator=g)
        xh = x.to(dtype)
        out["float32_s"] += _best(lambda: native.linear(x, w) if w32 is None else F.linear(x, w32))
        out["half_s"] += _best(lambda: F.linear(xh, w))
    return out


def half_matmul_is_fast(dtype: torch.dtype) -> bool:
    """Whether this CPU computes `dtype` (bf16 / fp16) decode products at least as fast as fp32 activations over the
    same stored weights: cached, else measured."""
    def run() -> dict:
        t = measure(dtype)
        return {**t, "fast": t["half_s"] <= t["float32_s"], "weight": list(WEIGHT)}
    return machine_cache.cached(machine_key(dtype), run, lambda e: isinstance(e.get("fast"), bool))["fast"]
