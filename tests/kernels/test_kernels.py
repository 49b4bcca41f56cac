"""The native CPU kernels against torch (`F.linear` on weights dequantised by torch code written here), on every
format, 1-16 rows, odd shapes and biases, on this CPU's SIMD path and on the portable one; a row's bits independent
of the rows and threads sharing the call; the grouped MoE op against the per-expert torch math; and the ways the
native path is refused (layout, build failure)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from specmoe import kernels
from specmoe.models.moe import ExpertMath, swiglu

# skipped only where the extension could not be built or loaded (no compiler) or is turned off (SPECMOE_NATIVE=0);
# a kernel that builds but computes wrong fails here
pytestmark = pytest.mark.skipif(kernels.state()["isa"] is None, reason=f"native kernels unavailable: "
                                f"{kernels.state()['reason']}")


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return {w for line in f if line.startswith("flags") for w in line.split(":", 1)[1].split()}
    except OSError:
        return set()


def test_this_cpu_gets_its_simd_path():
    """An AVX2 / AVX-512 CPU runs the native path on its SIMD kernels (they passed their self-test at load)."""
    flags = cpu_flags()
    if {"avx2", "fma", "f16c"} <= flags:
        assert kernels.available(), kernels.state()
        want = "native-avx512" if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags else "native-avx2"
        assert kernels.path() == want
    else:
        assert not kernels.available() and kernels.path() == "torch"


@pytest.fixture(params=["simd", "ref"])
def isa(request):
    """Each test on this CPU's SIMD path and on the portable one (the ISA restored after)."""
    before = kernels.state()["isa"].split(" ")[0]
    got = torch.ops.specmoe_kernels.set_isa("auto" if request.param == "simd" else "ref")
    if request.param == "simd":
        assert got.split(" ")[0] in kernels.SIMD, got  # the SIMD path this machine has, self-tested
    yield got
    torch.ops.specmoe_kernels.set_isa(before)


def quantize(w: torch.Tensor, fmt: str, group: int = 32):
    """(stored weight, scale, dequantised fp32 weight) of w [N, K] in `fmt`, by torch code independent of the
    kernel."""
    if fmt in ("float32", "bfloat16", "float16"):
        s = w.to(getattr(torch, fmt))
        return s, None, s.float()
    if fmt == "int8":
        scale = w.abs().amax(1) / 127
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        return q, scale, q.float() * scale[:, None]
    N, K = w.shape  # int4: groups of `group` along each row, fp16 scales, low nibble first
    g = w.view(N, K // group, group)
    scale = (g.abs().amax(-1) / 7).half()
    n = (torch.round(g / scale.float()[..., None]).clamp(-7, 7) + 8).to(torch.uint8).view(N, K)
    packed = n[:, 0::2] | (n[:, 1::2] << 4)
    deq = ((n.float() - 8).view(N, K // group, group) * scale.float()[..., None]).view(N, K)
    return packed, scale, deq


FORMATS = [("float32", 32), ("bfloat16", 32), ("float16", 32), ("int8", 32), ("int4", 32), ("int4", 64)]


@pytest.mark.parametrize("fmt,group", FORMATS)
@pytest.mark.parametrize("bias", [None, torch.float32, torch.bfloat16])
def test_linear_matches_torch(isa, fmt, group, bias):
    g = torch.Generator().manual_seed(0)
    N, K = 37, (200 if not fmt.startswith("int4") else 192)  # odd outputs; K with a tail of 8 (int4: whole groups)
    w = torch.randn(N, K, generator=g)
    stored, scale, deq = quantize(w, fmt, group)
    b = None if bias is None else torch.randn(N, generator=g).to(bias)
    for m in range(1, 17):
        x = torch.randn(m, K, generator=g)
        want = F.linear(x, deq, None if b is None else b.float())
        got = kernels.linear(x, stored, b, scale, group)
        assert got.shape == (m, N) and got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)


def test_linear_strided_weight_and_bf16_activations():
    """A weight that is a row-strided view (a slot of a packed expert) and bf16 activations (output in bf16)."""
    g = torch.Generator().manual_seed(1)
    big = torch.randn(50, 96, generator=g).bfloat16()
    w = big[3:40, 8:72]  # row stride 96, unit column stride
    x = torch.randn(5, 64, generator=g)
    torch.testing.assert_close(kernels.linear(x, w), F.linear(x, w.float()), rtol=1e-5, atol=1e-4)
    xb = x.bfloat16()
    got = kernels.linear(xb, w)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), F.linear(xb.float(), w.float()), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("fmt,group", FORMATS)
def test_rows_and_threads_do_not_change_a_rows_bits(fmt, group):
    """Each row alone, and under 1 and 2 threads, equals its row in a call of 16 rows, to the bit."""
    g = torch.Generator().manual_seed(2)
    N, K = 301, 256
    stored, scale, _ = quantize(torch.randn(N, K, generator=g), fmt, group)
    x = torch.randn(16, K, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        full = kernels.linear(x, stored, None, scale, group, invariant=True)
        torch.set_num_threads(1)
        assert torch.equal(kernels.linear(x, stored, None, scale, group, invariant=True), full)
    finally:
        torch.set_num_threads(threads)
    for i in range(16):
        assert torch.equal(kernels.linear(x[i:i + 1], stored, None, scale, group), full[i:i + 1])
    for a, b in ((0, 3), (3, 8), (5, 16)):
        assert torch.equal(kernels.linear(x[a:b], stored, None, scale, group), full[a:b])


def test_many_rows_take_blas_unless_invariant():
    """More than BLAS_ROWS rows: BLAS on the upcast weight (close to F.linear); `invariant` keeps the native rows."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(64, 128, generator=g).bfloat16()
    x = torch.randn(40, 128, generator=g)
    torch.testing.assert_close(kernels.linear(x, w), F.linear(x, w.float()), rtol=1e-5, atol=1e-4)
    inv = kernels.linear(x, w, invariant=True)
    assert torch.equal(inv[7:8], kernels.linear(x[7:8], w))


@pytest.mark.parametrize("act,limit", [("swiglu", None), ("swiglu", 7.0), ("relu", None)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_moe_op_matches_the_expert_math(isa, act, limit, dtype):
    """Every assignment of one slot group: its row equals `swiglu` (the torch expert math) on the upcast slot; rows
    of other groups (slot >= S) are left as they were."""
    g = torch.Generator().manual_seed(4)
    S, D, I, T, K = 5, 48, 40, 7, 3
    G = I if act == "relu" else 2 * I
    gate_up = (torch.randn(S, G, D, generator=g) * 0.3).to(dtype)
    down = (torch.randn(S, D, I, generator=g) * 0.3).to(dtype)
    gub = torch.randn(S, G, generator=g).to(dtype)
    db = torch.randn(S, D, generator=g).to(dtype)
    x = torch.randn(T, D, generator=g)
    slot = torch.randint(0, S + 2, (T * K,), generator=g)  # S, S + 1: another group's
    slot[:3] = torch.tensor([0, 0, S])  # a shared slot and a skipped row for sure
    scale = torch.rand(T * K, generator=g)
    math = ExpertMath(limit=limit, act=act)
    for biases, row_scale in ((False, None), (True, scale)):
        y = torch.full((T * K, D), 7.0)
        kernels.moe(x, slot, gate_up, down, y, k=K, act=act, limit=limit, row_scale=row_scale,
                    gate_up_bias=gub if biases else None, down_bias=db if biases else None)
        for a in range(T * K):
            s = int(slot[a])
            if s >= S:
                assert torch.equal(y[a], torch.full((D,), 7.0))
                continue
            xin = x[a // K: a // K + 1] * (1.0 if row_scale is None else float(row_scale[a]))
            want = swiglu(xin, gate_up[s].float(), down[s].float(), gub[s].float() if biases else None,
                          db[s].float() if biases else None, math)
            torch.testing.assert_close(y[a:a + 1], want, rtol=1e-4, atol=1e-4)


def test_unsupported_layout_is_one_clear_error():
    w = torch.randn(16, 32).t()  # column stride != 1
    with pytest.raises(RuntimeError, match="unit column stride"):
        kernels.linear(torch.randn(2, 16), w)
    with pytest.raises(RuntimeError, match="int4 rows must be whole groups"):
        kernels.linear(torch.randn(1, 40), torch.zeros(4, 20, dtype=torch.uint8), None,
                       torch.zeros(4, 1, dtype=torch.float16), 40)


def test_build_failure_falls_back_in_one_line(tmp_path, monkeypatch):
    """A source that does not compile: `_build` reports one line and the torch path is used (nothing raised)."""
    (tmp_path / "broken.cpp").write_text("this is not C++\n")
    monkeypatch.setattr(kernels, "CSRC", tmp_path)
    monkeypatch.setattr(kernels, "SOURCES", ("broken.cpp",))
    monkeypatch.setattr(kernels, "HEADERS", ())
    monkeypatch.setenv("SPECMOE_CACHE_DIR", str(tmp_path / "cache"))
    st = kernels._build()
    assert st["ok"] is False and "build or load failed" in st["reason"] and "\n" not in st["reason"]


def test_disabled_by_environment(monkeypatch):
    monkeypatch.setenv("SPECMOE_NATIVE", "0")
    assert kernels._build() == {"ok": False, "isa": None, "reason": "SPECMOE_NATIVE=0"}


@pytest.mark.parametrize("shape,wshape", [((1, 256), (256,)), ((7, 64), None), ((5, 6, 1, 64), (6, 1, 64)),
                                          ((3, 1000), (1000,)), ((300, 1024), (1024,))])
def test_rms_norm_matches_torch_and_a_row_is_alone(shape, wshape):
    """`rms_norm` against torch's (w · (x · rsqrt(mean(x²) + eps)), fp32): a weight per feature, none, and per-head
    weights tiling the rows ([heads, 1, D] over [N, heads, 1, D]); odd widths (a tail past the 8 partial sums); a large
    input split over threads; each row's bits the same computed alone."""
    g = torch.Generator().manual_seed(7)
    x = torch.randn(*shape, generator=g) * 3
    w = None if wshape is None else torch.randn(*wshape, generator=g)
    got = kernels.rms_norm(x, w, 1e-6)
    want = F.rms_norm(x, (shape[-1],), None, 1e-6)
    if w is not None:
        want = want * w
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    flat, gflat = x.reshape(-1, shape[-1]), got.reshape(-1, shape[-1])
    P = 1 if w is None else w.numel() // shape[-1]
    for r in (0, flat.shape[0] - 1):  # alone: the same weight row (r % P) as in the whole call
        wr = None if w is None else w.reshape(P, -1)[r % P]
        assert torch.equal(kernels.rms_norm(flat[r:r + 1], wr, 1e-6), gflat[r:r + 1])


def test_rms_norm_refuses_a_weight_that_does_not_tile_the_rows():
    with pytest.raises(RuntimeError, match="does not tile"):
        kernels.rms_norm(torch.randn(5, 64), torch.randn(2, 64), 1e-6)
