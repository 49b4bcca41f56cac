"""Tiny checkpoints that ship quantized weights as the published ones do, with their real key names and dtypes:
GPT-OSS with MXFP4 experts (`gate_up_proj_blocks` / `_scales` uint8, `down_proj_blocks` / `_scales`, bf16 biases
and non-expert weights) and DeepSeek-V3 with block-scaled FP8 (`float8_e4m3fn` weights with fp32
`weight_scale_inv`, one per 128x128 block, for the experts and every other linear; norms, router, embeddings
and lm_head bf16). Each is made from a transformers model saved with `save_pretrained` (bf16), then its weights
are replaced by their stored form."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.conftest import make_tiny_checkpoint

# MXFP4 blocks run along each projection's input in groups of 32: hidden and intermediate sizes are multiples of 32
MXFP4_SIZES = dict(hidden_size=64, intermediate_size=32)
# FP8 blocks are 128 x 128: a hidden size of 256 gives whole 2-block edges (transformers' dequantize=True loader
# derives the block size from the scale grid, so partial edge blocks are compared in tests/formats instead);
# every other size stays below one block
FP8_SIZES = dict(hidden_size=256, intermediate_size=256)
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
FP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3", "weight_block_size": [128, 128]}


def _rewrite(src: Path, dst: Path, tensors: dict, quantization_config: dict) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "quantization_config": quantization_config}))
    return dst


def make_mxfp4_checkpoint(path: Path, *, seed: int = 0, **overrides) -> Path:
    """GPT-OSS with random MXFP4 experts: uniformly random FP4 bytes, e8m0 scales 2^-8 .. 2^-3 (weights up to
    +-0.75, like the bf16 init)."""
    path = Path(path)
    src = make_tiny_checkpoint("gpt_oss", path / "bf16", dtype=torch.bfloat16, seed=seed,
                               **{**MXFP4_SIZES, **overrides})
    cfg = json.loads((src / "config.json").read_text())
    E, D, I = cfg["num_local_experts"], cfg["hidden_size"], cfg["intermediate_size"]
    g = torch.Generator().manual_seed(seed)
    out = {k: v for k, v in load_file(src / "model.safetensors").items()
           if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    for layer in range(cfg["num_hidden_layers"]):
        b = f"model.layers.{layer}.mlp.experts."
        for name, rows, cols in (("gate_up_proj", 2 * I, D), ("down_proj", D, I)):
            out[b + name + "_blocks"] = torch.randint(0, 256, (E, rows, cols // 32, 16), generator=g, dtype=torch.uint8)
            out[b + name + "_scales"] = torch.randint(119, 125, (E, rows, cols // 32), generator=g, dtype=torch.uint8)
    return _rewrite(src, path / "mxfp4", out, MXFP4_CONFIG)


def quantize_fp8(w: torch.Tensor, block=(128, 128)) -> tuple[torch.Tensor, torch.Tensor]:
    """float8_e4m3fn weight and fp32 scale_inv (one per block, max |w| of the block -> 448), as published."""
    br, bc = block
    R, C = w.shape
    s = torch.empty(math.ceil(R / br), math.ceil(C / bc))
    q = torch.empty(R, C, dtype=torch.float8_e4m3fn)
    w = w.float()
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            blk = w[i * br:(i + 1) * br, j * bc:(j + 1) * bc]
            s[i, j] = blk.abs().max().clamp_min(1e-12) / 448.0
            q[i * br:(i + 1) * br, j * bc:(j + 1) * bc] = (blk / s[i, j]).to(torch.float8_e4m3fn)
    return q, s


def make_fp8_checkpoint(path: Path, *, family: str = "deepseek_v3", seed: int = 0, **overrides) -> Path:
    """DeepSeek-V3 (or another family) with every linear (attention, dense and shared MLPs, routed experts)
    block-quantized to FP8."""
    path = Path(path)
    sizes = FP8_SIZES if family == "deepseek_v3" else {}
    src = make_tiny_checkpoint(family, path / "bf16", dtype=torch.bfloat16, seed=seed, **{**sizes, **overrides})
    out = {}
    for k, v in load_file(src / "model.safetensors").items():
        if k.endswith(("_proj.weight", "_proj_with_mqa.weight")):
            out[k], out[k + "_scale_inv"] = quantize_fp8(v)
        else:
            out[k] = v
    return _rewrite(src, path / "fp8", out, FP8_CONFIG)


def hf_dequantized(path: Path):
    """transformers' own loading path for the checkpoint, dequantising to fp32 on this CPU (Mxfp4Config /
    FineGrainedFP8Config with dequantize=True)."""
    import transformers as tf
    method = json.loads((Path(path) / "config.json").read_text())["quantization_config"]["quant_method"]
    if method == "fp8":  # transformers' FP8 loader refuses to run without accelerate (a dev extra)
        pytest.importorskip("accelerate")
    qc = tf.Mxfp4Config(dequantize=True) if method == "mxfp4" else tf.FineGrainedFP8Config(dequantize=True)
    return tf.AutoModelForCausalLM.from_pretrained(path, quantization_config=qc, dtype=torch.float32).eval()
