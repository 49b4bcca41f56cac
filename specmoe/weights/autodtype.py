"""`dtype="auto"` on a CPU: compute in the checkpoint's half dtype only where this CPU's half-precision matmul
is not slower than fp32's (many CPUs without AVX512-BF16 / AMX run bf16 matmuls several times slower).

The answer comes from a short micro-benchmark (a decode-sized matmul, [16, 1024] x [1024, 2048], each dtype
timed a few times, best of each) and is cached per machine in `<cache dir>/machine.json`, keyed by CPU model,
torch version, dtype and thread count, so it is measured once (`specmoe.machine_cache`).
"""
from __future__ import annotations

import time

import torch

from specmoe import machine_cache

SHAPE = (16, 1024, 2048)  # tokens x hidden x expert intermediate: the shape of decode-time expert GEMMs
REPEATS = 5


def machine_key(dtype: torch.dtype) -> str:
    return machine_cache.machine_key(str(dtype).replace("torch.", ""))


def measure(dtype: torch.dtype) -> dict:
    """Best-of-REPEATS seconds of one SHAPE matmul in fp32 and in `dtype` (CPU)."""
    m, k, n = SHAPE
    g = torch.Generator().manual_seed(0)
    a32, b32 = torch.randn(m, k, generator=g), torch.randn(k, n, generator=g)
    out = {}
    for name, (a, b) in (("float32", (a32, b32)), ("half", (a32.to(dtype), b32.to(dtype)))):
        a @ b  # warm up
        best = float("inf")
        for _ in range(REPEATS):
            t0 = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - t0)
        out[f"{name}_s"] = best
    return out


def half_matmul_is_fast(dtype: torch.dtype) -> bool:
    """Whether this CPU computes `dtype` (bf16 / fp16) matmuls at least as fast as fp32: cached, else measured."""
    def run() -> dict:
        t = measure(dtype)
        return {**t, "fast": t["half_s"] <= t["float32_s"], "shape": list(SHAPE)}
    return machine_cache.cached(machine_key(dtype), run, lambda e: isinstance(e.get("fast"), bool))["fast"]
