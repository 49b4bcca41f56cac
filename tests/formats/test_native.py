"""Checkpoints that ship quantized weights: the stored layout, its decode (chunked dequantisation exact against
transformers' functions), and one clear error for every malformed key, shape, dtype or quantization_config."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specmoe import LLM
from specmoe.errors import CheckpointError, InputError, UnsupportedModelError
from specmoe.experts.formats import ExpertShape, Native, make_format
from specmoe.weights import quantized
from specmoe.weights.checkpoint import Checkpoint
from tests.formats.native import make_fp8_checkpoint, make_mxfp4_checkpoint


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    d = tmp_path_factory.mktemp("native_checks")
    return {"mxfp4": make_mxfp4_checkpoint(d / "m"), "fp8": make_fp8_checkpoint(d / "f")}


@pytest.fixture
def copy(built, tmp_path):
    def get(method: str):
        dst = tmp_path / method
        shutil.copytree(built[method], dst)
        return dst
    return get


def edit_tensors(path, fn):
    sd = load_file(path / "model.safetensors")
    fn(sd)
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})


def edit_config(path, **quant):
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"] = {**cfg["quantization_config"], **quant}
    (path / "config.json").write_text(json.dumps(cfg))


def test_mxfp4_dequantization_in_chunks_is_exact(monkeypatch):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    g = torch.Generator().manual_seed(4)
    blocks = torch.randint(0, 256, (2, 7, 3, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 140, (2, 7, 3), generator=g, dtype=torch.uint8)
    monkeypatch.setattr(quantized, "BLOCKS_PER_PASS", 5)  # 42 blocks: 9 passes, the last partial
    for dtype in (torch.float32, torch.bfloat16):
        ref = convert_moe_packed_tensors(blocks, scales, dtype=dtype).transpose(1, 2)
        assert torch.equal(quantized.dequantize_mxfp4(blocks, scales, dtype), ref)
        out = torch.empty(2, 7, 96, dtype=dtype)
        quantized.dequantize_mxfp4(blocks, scales, out=out)
        assert torch.equal(out, ref)


def test_fp8_dequantization_in_chunks_with_partial_edge_blocks(monkeypatch):
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight
    g = torch.Generator().manual_seed(5)
    w = (torch.randn(300, 200, generator=g) * 4).to(torch.float8_e4m3fn)
    s = torch.rand(3, 2, generator=g) * 1e-2 + 1e-4
    monkeypatch.setattr(quantized, "VALUES_PER_PASS", 90 * 200)  # 90 rows per pass: 128-row blocks split
    ref = _dequantize_fp8_weight(w, s, [128, 128], torch.float32)
    assert torch.equal(quantized.dequantize_fp8_blocks(w, s, (128, 128), torch.float32), ref)
    # other dtypes: computed in fp32, rounded once (as transformers' loader does; its backward helper used here
    # multiplies in the target dtype)
    assert torch.equal(quantized.dequantize_fp8_blocks(w, s, (128, 128), torch.bfloat16), ref.bfloat16())


@pytest.mark.parametrize("method", ["mxfp4", "fp8"])
def test_stored_bytes_decode_to_the_resident_expert(method, built):
    ck = Checkpoint(built[method])
    fmt = make_format("checkpoint", ExpertShape.of(ck.config), ck.storage_dtype)
    assert isinstance(fmt, Native) and fmt.stored_bytes % 16 == 0 and not fmt.quantized
    layer = ck.config.moe_layers[-1]
    raw = fmt.from_checkpoint(ck, layer, 5)
    assert raw.dtype == torch.uint8 and raw.numel() == fmt.stored_bytes
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.empty(ck.config.expert_numel, dtype=dtype)
        fmt.decode(raw, out)
        assert torch.equal(out, ck.read_expert(layer, 5, dtype))
    # the stored bytes are the checkpoint's tensors themselves
    first = ck.read_stored(layer, 5)[0]
    assert torch.equal(raw[: first.numel() * first.element_size()], first.reshape(-1).view(torch.uint8))
    with pytest.raises(InputError, match="does not quantize"):
        fmt.encode(torch.zeros(ck.config.expert_numel))


def test_expert_format_must_match_the_checkpoint(built, tiny_ckpt):
    with pytest.raises(InputError, match="expert_format='mxfp4'.*stores them as float32"):
        LLM(tiny_ckpt("gpt_oss"), expert_format="mxfp4", offload="host")
    with pytest.raises(InputError, match="expert_format='fp8-block'.*stores them as mxfp4"):
        LLM(built["mxfp4"], expert_format="fp8-block", offload="host")


@pytest.mark.parametrize("method,edit,match", [
    ("mxfp4", lambda sd: sd.update({"model.layers.1.mlp.experts.gate_up_proj_blocks":
                                    sd["model.layers.1.mlp.experts.gate_up_proj_blocks"][..., :8].contiguous()}),
     r"gate_up_proj_blocks has shape \[8, 64, 2, 8\], expected \[8, 64, 2, 16\]"),
    ("mxfp4", lambda sd: sd.update({"model.layers.0.mlp.experts.down_proj_scales":
                                    sd["model.layers.0.mlp.experts.down_proj_scales"].bfloat16()}),
     "down_proj_scales in model.safetensors has dtype BF16; expected U8, as a mxfp4 checkpoint stores it"),
    ("mxfp4", lambda sd: sd.pop("model.layers.2.mlp.experts.down_proj_blocks"),
     "missing 1 tensor.*model.layers.2.mlp.experts.down_proj_blocks"),
    ("fp8", lambda sd: sd.pop("model.layers.1.mlp.experts.3.up_proj.weight_scale_inv"),
     "missing 1 tensor.*experts.3.up_proj.weight_scale_inv"),
    ("fp8", lambda sd: sd.update({"model.layers.2.mlp.experts.0.down_proj.weight":
                                  sd["model.layers.2.mlp.experts.0.down_proj.weight"].bfloat16()}),
     "experts.0.down_proj.weight in model.safetensors has dtype BF16; expected F8_E4M3"),
    ("fp8", lambda sd: sd.pop("model.layers.0.self_attn.o_proj.weight_scale_inv"),
     "missing 1 tensor.*self_attn.o_proj.weight_scale_inv"),
    ("fp8", lambda sd: sd.update({"model.layers.0.self_attn.o_proj.weight_scale_inv": torch.ones(1, 1)}),
     r"o_proj.weight_scale_inv has shape \[1, 1\], expected \[2, 1\]"),
    ("fp8", lambda sd: sd.update({"model.layers.0.mlp.up_proj.weight_scale_inv":
                                  sd["model.layers.0.mlp.up_proj.weight_scale_inv"].to(torch.float8_e4m3fn)}),
     "up_proj.weight_scale_inv in model.safetensors has dtype F8_E4M3; expected a floating dtype"),
    ("fp8", lambda sd: sd.update({"model.layers.0.input_layernorm.weight_scale_inv": torch.ones(1)}),
     "unexpected tensor.*input_layernorm.weight_scale_inv"),
])
def test_bad_tensors_are_one_clear_error(method, edit, match, copy):
    path = copy(method)
    edit_tensors(path, edit)
    with pytest.raises(CheckpointError, match=match):
        LLM(path)


@pytest.mark.parametrize("method,quant,err,match", [
    ("fp8", {"quant_method": "awq"}, UnsupportedModelError, "quant_method 'awq' is not supported"),
    ("fp8", {"quant_method": "mxfp4"}, UnsupportedModelError, "MXFP4.*GPT-OSS experts only"),
    ("mxfp4", {"quant_method": "fp8"}, UnsupportedModelError, "GPT-OSS checkpoints are read in floating point or"),
    ("fp8", {"weight_block_size": [128]}, CheckpointError, "weight_block_size must be a list of two integers"),
    ("fp8", {"activation_scheme": "static"}, UnsupportedModelError, "activation_scheme 'static'"),
    ("fp8", {"fmt": "e5m2"}, UnsupportedModelError, "fmt 'e5m2' is not supported"),
    ("fp8", {"weight_block_size": [64, 64]}, CheckpointError,
     r"q_a_proj.weight_scale_inv has shape \[1, 2\], expected \[1, 4\]"),
])
def test_bad_quantization_config_is_one_clear_error(method, quant, err, match, copy):
    path = copy(method)
    edit_config(path, **quant)
    with pytest.raises(err, match=match):
        LLM(path)


def test_fp8_tensors_need_a_quantization_config(copy):
    path = copy("fp8")
    cfg = json.loads((path / "config.json").read_text())
    del cfg["quantization_config"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="unexpected tensor.*weight_scale_inv.*must declare quantization_config"):
        LLM(path)
    edit_tensors(path, lambda sd: [sd.pop(k) for k in list(sd) if k.endswith("_scale_inv")])
    with pytest.raises(CheckpointError, match="has dtype F8_E4M3; expected a floating dtype.*declares quantization_"):
        LLM(path)


def test_mxfp4_sizes_must_be_whole_blocks(tmp_path):
    from specmoe.families import read_config
    cfg = json.loads((make_mxfp4_checkpoint(tmp_path) / "config.json").read_text())
    with pytest.raises(CheckpointError, match="intermediate_size must be a multiple of 32"):
        read_config({**cfg, "intermediate_size": 40})
