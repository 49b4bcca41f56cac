"""The widened copy (zero-padded hidden and expert width, rescaled norms and eps) computes the
same function: greedy tokens equal the original's (fp32 exactly, bf16 reported)."""
from __future__ import annotations

import json

import pytest
import torch

from specmoe.bench.widen import default_size, rule_of, widen_checkpoint, widened_copy
from specmoe.engine.llm import DEMO_MODEL


def _greedy(path, dtype, prompts, n=12):
    from specmoe import LLM, SamplingParams
    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in LLM(path, dtype=dtype, max_batch=len(prompts)).generate(prompts, sp)]


def test_rules_cover_qwen3_moe_keys():
    assert rule_of("model.layers.0.mlp.experts.3.down_proj.weight") == "exp_out"
    assert rule_of("model.layers.0.mlp.experts.3.gate_proj.weight") == "exp_in"
    assert rule_of("model.layers.0.mlp.gate.weight") == "hid1"
    assert rule_of("model.layers.0.self_attn.q_norm.weight") == "keep"
    assert rule_of("model.layers.0.post_attention_layernorm.weight") == "norm"
    with pytest.raises(ValueError):
        rule_of("model.layers.0.mystery.weight")


def test_widened_tiny_qwen3_moe_is_function_preserving(tiny_ckpt, tmp_path, hf_model):
    src = tiny_ckpt("qwen3_moe")
    dst = tmp_path / "wide"
    info = widen_checkpoint(src, dst, hidden=128, expert_intermediate=64)  # D 32→128 (4x), I 24→64
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["hidden_size"] == 128 and cfg["moe_intermediate_size"] == 64
    assert cfg["rms_norm_eps"] == pytest.approx(json.loads((src / "config.json").read_text())["rms_norm_eps"] / 4)
    assert info["bytes"] > 0
    prompts = [[1, 5, 9, 13, 17, 21, 25, 29], [3, 4, 5], [40, 41, 42, 43, 44, 45]]
    assert _greedy(dst, "float32", prompts) == _greedy(src, "float32", prompts)
    # transformers agrees that the widened config + weights compute the same logits
    x = torch.tensor([prompts[0]])
    with torch.no_grad():
        a, b = hf_model(src)(x).logits, hf_model(dst)(x).logits
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    # bf16: the norm scale is exactly 1/2, so only summation order can differ; reported, and equal here
    assert _greedy(dst, "bfloat16", prompts) == _greedy(src, "bfloat16", prompts)


def test_widened_copy_is_cached_and_checked(tiny_ckpt, tmp_path):
    src = tiny_ckpt("qwen3_moe")
    p1, info = widened_copy(src, cache_dir=tmp_path, expert_mb=0.05, progress=False)
    assert all(c["identical_sequences"] == c["sequences"] for c in info["greedy_check"] if c["dtype"] == "float32")
    p2, _ = widened_copy(src, cache_dir=tmp_path, expert_mb=0.05, progress=False)
    assert p1 == p2


@pytest.mark.slow
@pytest.mark.skipif(not (DEMO_MODEL / "config.json").is_file(), reason="demo model not trained yet")
def test_widened_demo_model_greedy(tmp_path):
    D2, I2 = default_size(DEMO_MODEL)
    assert 5 * 2**20 <= 3 * D2 * I2 * 2 <= 10 * 2**20, "experts of the widened demo model should be 5–10 MB"
    path, info = widened_copy(DEMO_MODEL, cache_dir=tmp_path, progress=False)
    fp32 = next(c for c in info["greedy_check"] if c["dtype"] == "float32")
    assert fp32["identical_sequences"] == fp32["sequences"]
