"""Expert storage formats: byte sizes, round trips, quantisation error bounds, and the published formats'
dequantisation exact against transformers' own code."""
from __future__ import annotations

import pytest
import torch

from specmoe.errors import InputError
from specmoe.experts.formats import ExpertShape, Int4, Int8, Plain, make_format
from specmoe.weights.quantized import dequantize_fp8_blocks, dequantize_mxfp4

SHAPE = ExpertShape(hidden=64, inter=40)  # rows of 40 are not a multiple of either int4 group


def _expert(seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(SHAPE.numel, generator=g) * 0.05
    w[:64] = 0.0  # an all-zero row / group
    return w


def test_plain_round_trip_and_upcast():
    w = _expert().to(torch.bfloat16)
    f = make_format("checkpoint", SHAPE, torch.bfloat16)
    assert isinstance(f, Plain) and f.stored_bytes == SHAPE.numel * 2 and f.identity(torch.bfloat16)
    b = f.encode(w)
    out = torch.empty(SHAPE.numel, dtype=torch.float32)
    f.decode(b, out)
    assert torch.equal(out, w.float())  # bf16 -> fp32 is exact


@pytest.mark.parametrize("name,cls,ratio", [("int8", Int8, 0.52), ("int4", Int4, 0.3), ("int4-g64", Int4, 0.3)])
def test_quantized_sizes_and_error(name, cls, ratio):
    f = make_format(name, SHAPE, torch.bfloat16)
    assert isinstance(f, cls) and f.quantized and not f.identity(torch.float32)
    demo = make_format(name, ExpertShape(hidden=256, inter=96), torch.bfloat16)  # the demo model's experts
    assert demo.stored_bytes <= ratio * demo.shape.numel * 2
    w = _expert()
    b = f.encode(w)
    assert b.dtype == torch.uint8 and b.numel() == f.stored_bytes
    out = torch.empty(SHAPE.numel)
    f.decode(b, out)
    assert torch.equal(out[:64], torch.zeros(64))
    off = 0
    for r, c in SHAPE.mats:  # error within half a quantisation step of each row / group
        m, d = w[off:off + r * c], out[off:off + r * c]
        if name == "int8":
            step = m.view(r, c).abs().amax(1, keepdim=True) / 127
            assert ((m.view(r, c) - d.view(r, c)).abs() <= step / 2 + 1e-7).all()
        else:
            assert (m - d).abs().max() <= m.abs().max() / 7 / 2 * 1.01
        off += r * c
    # decode is a pure function of the bytes: again, and in bf16, the same numbers
    again = torch.empty(SHAPE.numel)
    f.decode(b.clone(), again)
    assert torch.equal(out, again)
    half = torch.empty(SHAPE.numel, dtype=torch.bfloat16)
    f.decode(b, half)
    assert torch.equal(half, out.to(torch.bfloat16))


def test_int4_packs_two_nibbles_per_byte():
    f = Int4(ExpertShape(hidden=32, inter=32), group=32)
    w = torch.zeros(f.shape.numel)
    w[0], w[1], w[31] = 7.0, -7.0, 1.0  # scale 1 in group 0
    b = f.encode(w)
    assert b[0] == (15 | (1 << 4))  # low nibble = w[0] + 8, high nibble = w[1] + 8
    assert b[f.q_bytes:].view(torch.float16)[0] == 1.0


def test_bad_format_names():
    with pytest.raises(InputError, match="expert_format"):
        make_format("int3", SHAPE, torch.float32)
    with pytest.raises(InputError, match="group size"):
        Int4(SHAPE, group=16)


def test_mxfp4_exact_against_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    g = torch.Generator().manual_seed(1)
    E, out_f, G = 3, 10, 4  # GPT-OSS layout: [E, out, G, 16] blocks, [E, out, G] e8m0 scales
    blocks = torch.randint(0, 256, (E, out_f, G, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(127 - 20, 127 + 8, (E, out_f, G), generator=g, dtype=torch.uint8)
    for dtype in (torch.bfloat16, torch.float32):
        ref = convert_moe_packed_tensors(blocks, scales, dtype=dtype)  # [E, in, out]
        ours = dequantize_mxfp4(blocks, scales, dtype)  # [E, out, in]
        assert ours.dtype == dtype
        assert torch.equal(ours.transpose(1, 2), ref)


def test_fp8_block_dequant_exact_against_transformers():
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize, _dequantize_fp8_weight
    g = torch.Generator().manual_seed(2)
    w = (torch.randn(256, 384, generator=g) * 3).to(torch.float8_e4m3fn)
    s = torch.rand(2, 3, generator=g) * 1e-2 + 1e-4
    ref = Fp8Dequantize(None)._dequantize_one(w, s, output_dtype=torch.bfloat16)
    assert torch.equal(dequantize_fp8_blocks(w, s, (128, 128), torch.bfloat16), ref)
    # partial edge blocks (DeepSeek-V3 shapes are multiples of 128, others need not be)
    w2 = (torch.randn(200, 300, generator=g)).to(torch.float8_e4m3fn)
    s2 = torch.rand(2, 3, generator=g) * 1e-2
    ref2 = _dequantize_fp8_weight(w2, s2, [128, 128], torch.float32)
    assert torch.equal(dequantize_fp8_blocks(w2, s2, (128, 128), torch.float32), ref2)
    with pytest.raises(InputError, match="FP8 scales"):
        dequantize_fp8_blocks(w2, s2[:1], (128, 128))


@pytest.mark.parametrize("name", ["checkpoint", "int8", "int4-g64"])
def test_expert_biases_are_kept_exact(name):
    shape = ExpertShape(hidden=36, inter=20, bias=True)  # GPT-OSS packs [gate; up; down; biases]
    f = make_format(name, shape, torch.float32)
    w = torch.randn(shape.numel, generator=torch.Generator().manual_seed(3))
    assert shape.numel == 3 * 36 * 20 + 2 * 20 + 36
    out = torch.empty(shape.numel)
    f.decode(f.encode(w), out)
    assert torch.equal(out[shape.weights:], w[shape.weights:])
    assert (out[: shape.weights] - w[: shape.weights]).abs().max() < 0.5 * w.abs().max()
