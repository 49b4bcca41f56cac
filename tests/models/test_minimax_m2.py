"""MiniMax-M2 as a delta of the generic decoder, against transformers' own MiniMaxM2ForCausalLM (tiny random
checkpoints, tests/tiny_llama4_minimax.py; two seeds): fp32 logits within 1e-4 (batched ragged and single), greedy
equal; the released config.json's form (`rotary_dim` only); the router against transformers'; one clear error per
bad config value, shape and dtype."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specmoe import LLM, SamplingParams
from specmoe.errors import CheckpointError, SpecMoEError, UnsupportedModelError
from tests.tiny_llama4_minimax import GREEDY, PROMPTS, _one_thread, checkpoint, ckpt, load_hf  # noqa: F401 (fixtures)
from tests.hf_compare import hf_greedy, max_logit_diff





@pytest.mark.parametrize("variant", ["minimax_m2", "minimax_m2_s1"])
def test_logits_and_greedy_match_transformers(variant, ckpt):
    path = ckpt(variant)
    hf, llm = load_hf(path), LLM(path, dtype="float32")
    cfg = llm.config
    assert cfg.qk_norm == "full" and cfg.rotary_dim == 6 and cfg.score_correction_bias and cfg.norm_topk_prob
    assert max_logit_diff(llm, hf, PROMPTS) <= 1e-4
    outs = llm.generate(PROMPTS, GREEDY)
    for ids, out in zip(PROMPTS, outs):
        ref = hf_greedy(hf, ids, 10)
        assert out.token_ids == ref


def test_released_config_form_rotary_dim_only(tmp_path, ckpt):
    """The released config.json states partial rotation as `rotary_dim` (no partial_rotary_factor) and carries
    MiniMax's own switches at the values transformers implements."""
    src = ckpt("minimax_m2")
    dst = tmp_path / "released"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    theta = cfg.pop("rope_parameters")["rope_theta"]
    cfg.update(rope_theta=theta, rotary_dim=6, scoring_func="sigmoid", use_qk_norm=True, qk_norm_type="per_layer",
               use_routing_bias=True, shared_intermediate_size=0, attn_type_list=[1, 1, 1])
    (dst / "config.json").write_text(json.dumps(cfg))
    llm = LLM(dst, dtype="float32")
    assert llm.config.rotary_dim == 6 and llm.config.rope_theta == theta == 5e6
    hf = load_hf(src)  # its rope_parameters: partial_rotary_factor 0.6
    assert max_logit_diff(llm, hf, PROMPTS[:2]) <= 1e-4


def test_router_matches_transformers(ckpt):
    from transformers import AutoConfig
    from transformers.models.minimax_m2.modeling_minimax_m2 import MiniMaxM2TopKRouter

    from specmoe.models.routers import route
    torch.manual_seed(0)
    cfg = AutoConfig.from_pretrained(ckpt("minimax_m2"))
    ref = MiniMaxM2TopKRouter(cfg)
    with torch.no_grad():
        ref.weight.normal_(0.0, 0.5)
    bias = torch.randn(cfg.num_local_experts) * 0.5
    x = torch.randn(33, cfg.hidden_size)
    with torch.no_grad():
        logits, ref_w, ref_ids = ref(x, bias)
    w, ids = route("minimax_m2", logits, top_k=3, norm_topk_prob=True, correction_bias=bias)
    ids_s, order = ids.sort(-1)
    ref_s, ref_order = ref_ids.sort(-1)
    assert torch.equal(ids_s, ref_s)
    assert torch.allclose(w.gather(1, order), ref_w.gather(1, ref_order), atol=1e-6)
    assert not torch.equal(logits.topk(3, -1)[1].sort(-1)[0], ids_s), "the correction bias changed the picks"


@pytest.mark.parametrize("change,error,match", [
    ({"scoring_func": "softmax"}, UnsupportedModelError, r"scoring_func 'softmax' is not supported"),
    ({"use_qk_norm": False}, UnsupportedModelError, r"use_qk_norm=false is not supported"),
    ({"use_routing_bias": False}, UnsupportedModelError, r"use_routing_bias=false is not supported"),
    ({"qk_norm_type": "per_head"}, UnsupportedModelError, r"qk_norm_type 'per_head' is not supported"),
    ({"shared_intermediate_size": 64}, UnsupportedModelError, r"shared_intermediate_size > 0"),
    ({"attn_type_list": [0, 1, 1]}, UnsupportedModelError, r"attn_type_list other than all 1"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, "rotary_dim": 5}, CheckpointError,
     r"rotary_dim must be a value that leaves an even number >= 2 of the 10 head dims rotating; got 5"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}, "rotary_dim": 12}, CheckpointError,
     r"rotary_dim must be an integer in \[1, 10\]; got 12"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, UnsupportedModelError,
     r"rope type 'yarn' is not supported for minimax_m2"),
    ({"quantization_config": {"quant_method": "mxfp4"}}, UnsupportedModelError, r"MXFP4 .* GPT-OSS experts only"),
])
def test_bad_config_is_one_clear_error(change, error, match, tmp_path, ckpt):
    dst = tmp_path / "bad"
    shutil.copytree(ckpt("minimax_m2"), dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(error, match=match):
        LLM(dst)


@pytest.mark.parametrize("key,tensor,match", [
    ("model.layers.0.block_sparse_moe.e_score_correction_bias", torch.zeros(7),
     r"e_score_correction_bias has shape \[7\], expected \[8\]"),
    ("model.layers.1.self_attn.q_norm.weight", torch.ones(10),
     r"q_norm.weight has shape \[10\], expected \[40\]"),
    ("model.layers.2.block_sparse_moe.experts.5.w2.weight", torch.zeros(36, 20, dtype=torch.int8),
     r"w2.weight in model.safetensors has dtype I8; expected a floating dtype"),
])
def test_bad_tensor_is_one_clear_error(key, tensor, match, tmp_path, ckpt):
    dst = tmp_path / "bad"
    shutil.copytree(ckpt("minimax_m2"), dst)
    sd = load_file(dst / "model.safetensors")
    sd[key] = tensor
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(SpecMoEError, match=match):
        LLM(dst)


def test_inspect_describes_the_family(ckpt):
    from specmoe.cli.inspect import describe
    info = describe(ckpt("minimax_m2"))
    assert info["family"] == "minimax_m2" and info["attention"] == "gqa" and info["dense_layers"] == 0
    assert info["layer_kinds"] == ["moe"] * 3 and not info["shared_experts"]
    assert info["bytes_per_expert"] == 3 * 20 * 36 * 4


def test_fp8_release_matches_transformers_dequantized(tmp_path):
    """MiniMax-M2 ships block-scaled FP8 (fmt "float8_e4m3fn", the router and correction bias in floating point):
    read as stored, its logits and greedy tokens equal transformers' dequantised model's. Sizes are whole
    128 x 128 blocks (transformers' dequantising loader derives the block from the scale grid)."""
    from tests.formats.native import _rewrite, hf_dequantized, quantize_fp8
    from tests.tiny_llama4_minimax import make
    src = make("minimax_m2", tmp_path / "bf16", dtype=torch.bfloat16, hidden_size=256, intermediate_size=256,
               head_dim=64, rotary_dim=32, num_hidden_layers=2)
    out = {}
    for k, v in load_file(src / "model.safetensors").items():
        if k.endswith(("_proj.weight", ".w1.weight", ".w2.weight", ".w3.weight")):
            out[k], out[k + "_scale_inv"] = quantize_fp8(v)
        else:
            out[k] = v
    path = _rewrite(src, tmp_path / "fp8", out, {
        "quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "float8_e4m3fn",
        "weight_block_size": [128, 128], "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]})
    hf, llm = hf_dequantized(path), LLM(path, dtype="float32")
    assert llm.config.quantization.method == "fp8"
    assert max_logit_diff(llm, hf, PROMPTS[:3]) <= 1e-4
    for ids, out in zip(PROMPTS[:2], llm.generate(PROMPTS[:2], GREEDY)):
        ref = hf_greedy(hf, ids, 10)
        assert out.token_ids == ref
