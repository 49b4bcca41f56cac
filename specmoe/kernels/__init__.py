"""specmoe's native CPU kernels: y = x·Wᵀ (+ bias) for a few rows of fp32 activations and W in its stored format
(fp32, bf16, fp16, int8 with a scale per row, int4 with an fp16 scale per group), reading W once per call and
accumulating in fp32; and `moe`, every routed assignment of one MoE layer's slot group in one call (gate/up
projection, SwiGLU / ReLU / GPT-OSS's clamped SwiGLU, down projection); and `rms_norm` over fp32 rows (one op for a
decode row's norm, per-head weights included).

The C++ lives in `csrc/` (one body, `gemv_impl.h`, compiled per ISA: AVX2 + FMA + F16C, AVX-512, portable). It is
built on first use with torch's `cpp_extension` (ninja), kept under `<cache dir>/kernels/<torch version>-<source
hash>/` and rebuilt when the source or torch changes. At load the best ISA this CPU has is chosen and self-tested
against the portable kernel; a path that disagrees is not used.

`available()` says whether the native path is on: it is off (one line says why, and the torch path runs) where the
build fails, no compiler is found, the CPU has neither AVX2 nor AVX-512, or `SPECMOE_NATIVE=0`. `SPECMOE_KERNEL_ISA`
(`auto`, `avx512`, `avx2`, `ref`) picks the ISA (tests run the portable one against the SIMD ones).
"""
from __future__ import annotations

import hashlib
import os
import sys
import threading
import time
import warnings
from pathlib import Path

import torch

from specmoe import machine_cache

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("ops.cpp", "gemv_ref.cpp", "gemv_avx2.cpp", "gemv_avx512.cpp")
HEADERS = ("gemv.h", "gemv_impl.h", "i4_x86.h")
FLAGS = ["-O3", "-std=c++17", "-fopenmp", "-ffp-contract=off"]  # no contraction: a row's bits fixed per ISA
SIMD = ("avx2", "avx512")
BLAS_ROWS = 16  # rows per weight up to which the native product runs (more: BLAS, inside the same op)

_lock = threading.Lock()
_state: dict = {}


def source_hash() -> str:
    h = hashlib.sha256()
    for name in SOURCES + HEADERS:
        h.update(name.encode())
        h.update((CSRC / name).read_bytes())
    h.update(" ".join(FLAGS).encode())
    return h.hexdigest()[:16]


def build_dir() -> Path:
    version = torch.__version__.replace("+", "_")
    return machine_cache.cache_file().parent / "kernels" / f"torch-{version}-{source_hash()}"


def _say(msg: str) -> None:
    print(f"specmoe: {msg}", file=sys.stderr, flush=True)


def _build() -> dict:
    """Build (or find the cached build) and load the extension: {"ok", "isa", "reason", "build_s"}."""
    if os.environ.get("SPECMOE_NATIVE", "1").lower() in ("0", "false", "no", "off"):
        return {"ok": False, "isa": None, "reason": "SPECMOE_NATIVE=0"}
    try:
        from torch.utils import cpp_extension
    except ImportError as e:  # pragma: no cover - torch always ships it
        return {"ok": False, "isa": None, "reason": f"torch.utils.cpp_extension unavailable ({e})"}
    out = build_dir()
    fresh = not any(out.glob("*.so"))
    t0 = time.perf_counter()
    try:
        out.mkdir(parents=True, exist_ok=True)
        if fresh:
            _say(f"building the native CPU kernels (first use, about a minute) in {out} ...")
        cpp_extension.load(name=f"specmoe_kernels_{source_hash()}", sources=[str(CSRC / s) for s in SOURCES],
                           extra_cflags=FLAGS, extra_ldflags=["-fopenmp"], build_directory=str(out),
                           is_python_module=False, verbose=False)
    except (OSError, RuntimeError, ImportError, Exception) as e:  # a compiler, ninja, or the build: any failure
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return {"ok": False, "isa": None, "reason": f"native kernels unavailable, build or load failed: {first}"}
    build_s = time.perf_counter() - t0
    if fresh:
        _say(f"native CPU kernels built in {build_s:.0f} s")
    want = os.environ.get("SPECMOE_KERNEL_ISA", "auto")
    isa = torch.ops.specmoe_kernels.set_isa(want) if want != "auto" else torch.ops.specmoe_kernels.isa()
    name = isa.split(" ")[0]
    if name not in SIMD and want != "ref":
        why = "a SIMD path failed its self-test" if "self-test" in isa else "this CPU has neither AVX2+FMA nor AVX-512"
        return {"ok": False, "isa": isa, "reason": f"{why} ({isa})", "build_s": build_s}
    return {"ok": True, "isa": isa, "reason": None, "build_s": build_s}


def state() -> dict:
    """The native path's state, built and loaded once per process (a failure is said once, in one line)."""
    with _lock:
        if not _state:
            _state.update(_build())
            if not _state["ok"] and _state["reason"] != "SPECMOE_NATIVE=0":
                warnings.warn(f"specmoe: {_state['reason']}; using the torch path", RuntimeWarning, stacklevel=3)
        return _state


def available() -> bool:
    return state()["ok"]


def set_enabled(on: bool) -> None:
    """Turn the native path on or off for this process (tests run both paths; `SPECMOE_NATIVE` at start-up)."""
    st = state()
    if on and st.get("isa") is None:
        raise RuntimeError(f"the native kernels cannot be enabled: {st['reason']}")
    st["ok"] = bool(on)


def path() -> str:
    """Which kernel path runs: "native-avx2", "native-avx512", "native-ref" or "torch"."""
    st = state()
    return f"native-{st['isa'].split(' ')[0]}" if st["ok"] else "torch"


def _ops():
    """The extension's ops (loaded on first use; a caller checks `available()` first)."""
    if not _state:
        state()
    return torch.ops.specmoe_kernels


def linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, scale: torch.Tensor | None = None,
           group: int = 32, invariant: bool = False) -> torch.Tensor:
    """x [..., K] · wᵀ (+ bias) with w [N, K] (fp32 / bf16 / fp16; int8 with `scale` [N] fp32; int4 as uint8
    [N, K/2], low nibble first, with `scale` fp16 [N, K/group]) → [..., N] in x's dtype. More than BLAS_ROWS rows
    take BLAS on the upcast weight, unless `invariant` (every row then gets the bits it gets alone)."""
    return _ops().linear(x, w, bias, scale, group, 0 if invariant else BLAS_ROWS)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """w · (x · rsqrt(mean(x²) + eps)) over the last dim of fp32 CPU `x`, one op; `weight` fp32 [D], or [P, ..., D]
    (row r of x, counted over its leading dims, takes weight row r % P: per-head norms), or None. A row's result
    does not depend on the other rows."""
    return _ops().rms_norm(x, weight, eps)


ACTS = {"swiglu": 0, "relu": 1, "swiglu-clamped": 2}


def moe(x: torch.Tensor, slot: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, y: torch.Tensor, *,
        k: int, act: str = "swiglu", limit: float | None = None, alpha: float = 1.702,
        gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
        gate_up_scale: torch.Tensor | None = None, down_scale: torch.Tensor | None = None, group: int = 32,
        row_scale: torch.Tensor | None = None, invariant: bool = False) -> None:
    """Writes y [T·k, D] fp32 rows of every assignment whose `slot` [T·k] is below S (gate_up [S, G, D], down
    [S, D, I]); assignment a reads token a // k of x [T, D], times `row_scale[a]` when given. An expert with more than
    BLAS_ROWS rows takes BLAS, unless `invariant`."""
    code = ACTS["swiglu-clamped"] if (act == "swiglu" and limit is not None) else ACTS[act]
    _ops().moe(x, slot, gate_up, down, gate_up_bias, down_bias, gate_up_scale, down_scale,
                                  group, code, float(limit or 0.0), float(alpha), row_scale, k,
                                  0 if invariant else BLAS_ROWS, y)
