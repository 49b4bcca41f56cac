"""How many rows an fp32 CPU matmul needs so that a row's bits do not depend on the rows beside it, measured on
this machine (a `deterministic` model pads every smaller matmul to that many rows, `layers.linear`).

CPU sgemm takes another kernel (a small-matrix path, a matrix-vector one) below some row count, and that kernel
rounds a row differently; where the switch lies depends on the CPU and the BLAS build: 4 rows sufficed on the AMD
EPYC machines this project ran on before, an Intel Xeon (AVX-512) needs up to 16, growing with the contraction
length. `probe` multiplies a first m rows for every m below `PROBE_ROWS` against the same rows inside
`PROBE_ROWS` (linear, addmm, bmm with either layout of its second operand; contraction lengths of real models) and
returns the smallest count from which every result is equal; it is measured once per CPU, torch build and thread
count and kept in the machine cache (`specmoe.machine_cache`)."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from specmoe import machine_cache

CONTRACTIONS = (16, 32, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 2880, 4096, 7168, 8192)
OUT = 64  # output columns of a probe (the row classes here do not depend on them)
PROBE_ROWS = 64


def probe(contractions=CONTRACTIONS) -> dict:
    """{"rows": the smallest row count from which a row's result is the same at every larger count, for every op
    and contraction length probed; per op and length: "by_op": {op: {K: rows}}}."""
    g = torch.Generator().manual_seed(0)
    by_op: dict[str, dict[int, int]] = {"linear": {}, "addmm": {}, "bmm": {}, "bmm_t": {}}
    for K in contractions:
        w = torch.randn(OUT, K, generator=g)
        x = torch.randn(PROBE_ROWS, K, generator=g)
        acc = torch.randn(PROBE_ROWS, OUT, generator=g)
        xb, wb = torch.randn(2, PROBE_ROWS, K, generator=g), torch.randn(2, K, OUT, generator=g)
        wt = torch.randn(2, OUT, K, generator=g).transpose(1, 2)  # attention's q @ kᵀ
        ops = {"linear": lambda m: F.linear(x[:m], w), "addmm": lambda m: torch.addmm(acc[:m], x[:m], w.T),
               "bmm": lambda m: torch.bmm(xb[:, :m], wb), "bmm_t": lambda m: torch.bmm(xb[:, :m], wt)}
        for name, op in ops.items():
            ref = op(PROBE_ROWS)
            unequal = [m for m in range(1, PROBE_ROWS)
                       if not torch.equal(op(m), ref[:, :m] if name.startswith("bmm") else ref[:m])]
            by_op[name][K] = max(unequal) + 1 if unequal else 1
    return {"rows": max(r for per in by_op.values() for r in per.values()), "by_op": {op: {str(k): v for k, v in per.items()} for op, per in by_op.items()},
            "probe_rows": PROBE_ROWS}


@functools.cache
def _rows(threads: int) -> int:
    entry = machine_cache.cached(machine_cache.machine_key("fp32 matmul row classes"), probe,
                                 lambda e: isinstance(e.get("rows"), int) and e["rows"] >= 1)
    return entry["rows"]


def deterministic_rows() -> int:
    """Rows a `deterministic` model pads every smaller fp32 matmul to (linear, addmm, the fixed-split attention's
    bmm; measured once, see the module docstring); at least 2, since rows > 1 is what marks a deterministic
    model's modules."""
    return max(2, _rows(torch.get_num_threads()))
