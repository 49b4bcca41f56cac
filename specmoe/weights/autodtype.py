"""`dtype="auto"` on a CPU: compute in the checkpoint's half dtype only where this CPU's half-precision matmul
is not slower than fp32's (many CPUs without AVX512-BF16 / AMX run bf16 matmuls several times slower).

The answer comes from a short micro-benchmark (a decode-sized matmul, [16, 1024] x [1024, 2048], each dtype
timed a few times, best of each) and is cached per machine in `<cache dir>/machine.json`, keyed by CPU model,
torch version, dtype and thread count, so it is measured once. The cache dir is `$SPECMOE_CACHE_DIR`, else
`$XDG_CACHE_HOME/specmoe`, else `~/.cache/specmoe`.
"""
from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

SHAPE = (16, 1024, 2048)  # tokens x hidden x expert intermediate: the shape of decode-time expert GEMMs
REPEATS = 5


def cache_file() -> Path:
    base = os.environ.get("SPECMOE_CACHE_DIR")
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = str(Path(xdg) / "specmoe") if xdg else str(Path.home() / ".cache" / "specmoe")
    return Path(base) / "machine.json"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def machine_key(dtype: torch.dtype) -> str:
    return f"{cpu_model()} | torch {torch.__version__} | {str(dtype).replace('torch.', '')} | " \
           f"{torch.get_num_threads()} threads"


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


def _load(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def half_matmul_is_fast(dtype: torch.dtype) -> bool:
    """Whether this CPU computes `dtype` (bf16 / fp16) matmuls at least as fast as fp32: cached, else measured."""
    path, key = cache_file(), machine_key(dtype)
    entry = _load(path).get(key)
    if not (isinstance(entry, dict) and isinstance(entry.get("fast"), bool)):
        t = measure(dtype)
        entry = {**t, "fast": t["half_s"] <= t["float32_s"], "shape": list(SHAPE), "measured": time.time()}
        try:  # best effort: an unwritable cache only means measuring again next time
            path.parent.mkdir(parents=True, exist_ok=True)
            data = _load(path)
            data[key] = entry
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data, indent=1))
            os.replace(tmp, path)
        except OSError:
            pass
    return entry["fast"]
