"""Llama-4 as a delta of the generic decoder, against transformers' own Llama4ForCausalLM and the multimodal
Llama4ForConditionalGeneration (tiny random checkpoints, tests/tiny_llama4_minimax.py): fp32 logits within 1e-4
(batched ragged and single, prompts longer than the attention chunk), greedy equal; a verification forward over the
KV cache with a chunk boundary inside it (after a rejected draft); the layer layout (dense / MoE, NoPE, chunked);
the router; and one clear error per bad config value, shape or dtype."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specmoe import LLM, SamplingParams
from specmoe.errors import CheckpointError, SpecMoEError, UnsupportedModelError
from specmoe.weights.checkpoint import Checkpoint
from tests.tiny_llama4_minimax import GREEDY, PROMPTS, _one_thread, checkpoint, ckpt, load_hf  # noqa: F401 (fixtures)
from tests.hf_compare import hf_greedy, max_logit_diff





@pytest.mark.filterwarnings("ignore:.*vision tower")
@pytest.mark.parametrize("variant", ["llama4", "llama4_top2", "llama4_mm"])
def test_logits_and_greedy_match_transformers(variant, ckpt):
    path = ckpt(variant)
    hf, llm = load_hf(path), LLM(path, dtype="float32")
    assert max_logit_diff(llm, hf, PROMPTS) <= 1e-4
    outs = llm.generate(PROMPTS, GREEDY)
    for ids, out in zip(PROMPTS, outs):
        ref = hf_greedy(hf, ids, 10)
        assert out.token_ids == ref


def test_layer_layout_and_inspect(ckpt):
    from specmoe.cli.inspect import describe
    cfg = LLM(ckpt("llama4"), dtype="float32").config
    assert cfg.model_type == "llama4_text" and cfg.moe_layers == (1, 3) and cfg.dense_intermediate_size == 44
    assert cfg.nope_layers == (1, 4) and cfg.chunked_layers == (0, 2, 3) and cfg.attention_chunk_size == 5
    assert cfg.qk_norm == "l2" and cfg.attn_floor_scale == 3 and cfg.attn_scale == 0.3 and cfg.rope_interleave
    assert cfg.routed_input_scaled and cfg.shared_expert_intermediate_size == 20 and not cfg.shared_expert_gate
    assert cfg.llama3_rope is not None and cfg.llama3_rope.factor == 8.0
    info = describe(ckpt("llama4"))
    assert info["family"] == "llama4_text" and info["rope"] == "llama3" and info["dense_layers"] == 3
    assert info["layer_kinds"] == ["dense chunked 5", "moe nope", "dense chunked 5", "moe chunked 5", "dense nope"]
    assert info["bytes_per_expert"] == cfg.expert_numel * 4


@pytest.mark.filterwarnings("ignore:.*vision tower")
def test_multimodal_release_reads_its_language_model_and_skips_the_vision_tower(ckpt):
    path = ckpt("llama4_mm")
    with pytest.warns(UserWarning, match=r"tensors under vision_model\., multi_modal_projector\. .* not loaded"):
        llm = LLM(path, dtype="float32")
    cfg = llm.config
    assert cfg.model_type == "llama4_text" and cfg.weight_prefix == "language_model.model."
    assert cfg.head_prefix == "language_model." and cfg.skipped_prefixes == ("vision_model.", "multi_modal_projector.")
    assert cfg.nope_layers == (1, 4) and cfg.chunked_layers == (0, 2, 3)
    # one expert cut from the fused tensors under language_model.: gate columns [0, I), up [I, 2I), transposed
    sd = load_file(path / "model.safetensors")
    gu = sd["language_model.model.layers.1.feed_forward.experts.gate_up_proj"][2]  # [D, 2I]
    down = sd["language_model.model.layers.1.feed_forward.experts.down_proj"][2]  # [I, D]
    I, D = cfg.expert_intermediate_size, cfg.hidden_size
    packed = Checkpoint(path).read_expert(1, 2)
    assert torch.equal(packed, torch.cat([gu[:, :I].T.reshape(-1), gu[:, I:].T.reshape(-1), down.T.reshape(-1)]))
    assert packed.numel() == 3 * I * D


def test_verification_across_a_chunk_boundary_after_a_rejection(ckpt):
    """A multi-token forward over the cache whose tokens straddle a chunk boundary (chunk 5: positions 8, 9 | 10,
    11, 12) gives transformers' full-sequence logits, also after a rejected draft left scratch K/V behind."""
    from specmoe.decoding.runtime.runner import ModelRunner
    from specmoe.decoding.runtime.sequence import Sequence
    from specmoe.models.kv_cache import KVCache
    path = ckpt("llama4")
    hf, llm = load_hf(path), LLM(path, dtype="float32")
    cfg = llm.config
    ids = PROMPTS[0][:13]
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0]  # [13, V]
    cache = KVCache(num_layers=cfg.num_layers, max_batch=1, max_seq=32, num_kv_heads=cfg.num_kv_heads,
                    head_dim=cfg.head_dim, dtype=torch.float32)
    cache.lengths = [0]
    runner = ModelRunner(llm.model, llm.store, cache, torch.device("cpu"))
    seq = Sequence(0, ids, GREEDY, 0, torch.Generator())
    runner.forward([seq], [ids[:8]])
    runner.commit(seq, 8)
    # verify the pending token 8 and three wrong drafts (positions 8..11, the boundary at 10): row 0 is right
    wrong = [(t + 1) % 96 for t in ids[9:12]]
    out = runner.forward([seq], [[ids[8]] + wrong], all_logits=True)[0]
    assert (out[0] - ref[8]).abs().max().item() <= 1e-4
    assert (out[2] - ref[10]).abs().max().item() > 1e-3, "the wrong drafts changed what follows"
    runner.commit(seq, 1)  # the drafts are rejected: position 8 is committed, 9..11 hold scratch K/V
    out = runner.forward([seq], [ids[9:13]], all_logits=True)[0]  # positions 9..12, the boundary at 10
    assert (out - ref[9:13]).abs().max().item() <= 1e-4


def test_scout_rope_scaling_equal_freq_factors_matches_transformers(ckpt):
    """Llama-4 Scout's release sets low_freq_factor == high_freq_factor (no interpolated band)."""
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 16.0, "low_freq_factor": 1.0,
            "high_freq_factor": 1.0, "original_max_position_embeddings": 64}
    path = ckpt("llama4", rope_parameters=rope)
    hf, llm = load_hf(path), LLM(path, dtype="float32")
    assert llm.config.llama3_rope.high_freq_factor == llm.config.llama3_rope.low_freq_factor == 1.0
    assert max_logit_diff(llm, hf, PROMPTS[:2]) <= 1e-4


def test_router_matches_transformers(ckpt):
    """top-k of the logits, then the sigmoid of the chosen ones (transformers' Llama4Router, whose scores are
    sigmoid(-inf) = 0 off the top-k)."""
    from transformers import AutoConfig
    from transformers.models.llama4.modeling_llama4 import Llama4Router

    from specmoe.models.routers import route
    torch.manual_seed(0)
    cfg = AutoConfig.from_pretrained(ckpt("llama4_top2"))
    ref = Llama4Router(cfg)
    x = torch.randn(33, cfg.hidden_size)
    with torch.no_grad():
        scores, logits = ref(x)
    w, ids = route("llama4_text", logits, top_k=2, norm_topk_prob=False)
    assert torch.equal(ids.sort(-1)[0], scores.topk(2, -1)[1].sort(-1)[0])
    assert torch.allclose(scores.gather(1, ids), w, atol=1e-7)
    assert torch.equal((scores > 0).sum(-1), torch.full((33,), 2))


@pytest.mark.parametrize("change,error,match", [
    ({"moe_layers": [1, 9]}, CheckpointError, r"moe_layers must be a non-empty list of distinct layer indices"),
    ({"no_rope_layers": [1, 0]}, CheckpointError, r"no_rope_layers must be a list of 5 entries"),
    ({"no_rope_layers": [1, 2, 1, 1, 0]}, CheckpointError, r"no_rope_layers must be a list of 5 entries"),
    ({"layer_types": ["chunked_attention"] * 4}, CheckpointError, r"layer_types must be a list of 5 entries"),
    ({"attention_chunk_size": None}, CheckpointError, r"attention_chunk_size must be an integer >= 1 \(layer_types"),
    ({"attention_chunk_size": 0}, CheckpointError, r"attention_chunk_size must be an integer >= 1; got 0"),
    ({"interleave_moe_layer_step": 0}, CheckpointError, r"interleave_moe_layer_step must be an integer in"),
    ({"attn_temperature_tuning": "yes"}, CheckpointError, r"attn_temperature_tuning must be true, false or"),
    ({"floor_scale": 0}, CheckpointError, r"floor_scale must be a finite number > 0"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0}}, UnsupportedModelError,
     r"rope type 'dynamic' is not supported for llama4_text"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                          "original_max_position_embeddings": 256}}, CheckpointError,
     r"high_freq_factor must be a finite number > 0; it is missing"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 4.0,
                          "high_freq_factor": 1.0, "original_max_position_embeddings": 256}}, CheckpointError,
     r"high_freq_factor must be a number >= low_freq_factor"),
    ({"quantization_config": {"quant_method": "fp8"}}, UnsupportedModelError,
     r"Llama-4 checkpoints are read in floating point, not FP8"),
])
def test_bad_config_is_one_clear_error(change, error, match, tmp_path, ckpt):
    dst = tmp_path / "bad"
    shutil.copytree(ckpt("llama4"), dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(error, match=match):
        LLM(dst)


def test_multimodal_config_without_text_config_is_one_clear_error(tmp_path, ckpt):
    dst = tmp_path / "mm"
    shutil.copytree(ckpt("llama4_mm"), dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "text_config": None}))
    with pytest.raises(CheckpointError, match=r"config.json \(llama4\): text_config must be an object"):
        LLM(dst)
    (dst / "config.json").write_text(json.dumps({**cfg, "text_config": {**cfg["text_config"],
                                                                        "model_type": "llama"}}))
    with pytest.raises(CheckpointError, match=r"text_config.model_type must be 'llama4_text'; got 'llama'"):
        LLM(dst)


@pytest.mark.parametrize("key,tensor,match", [
    ("model.layers.1.feed_forward.experts.gate_up_proj", torch.zeros(7, 36, 38),
     r"gate_up_proj has shape \[7, 36, 38\], expected \[7, 36, 40\]"),
    ("model.layers.3.feed_forward.experts.down_proj", torch.zeros(7, 36, 20),
     r"down_proj has shape \[7, 36, 20\], expected \[7, 20, 36\]"),
    ("model.layers.0.feed_forward.gate_proj.weight", torch.zeros(44, 36, dtype=torch.int32),
     r"gate_proj.weight in model.safetensors has dtype I32; expected a floating dtype"),
])
def test_bad_tensor_is_one_clear_error(key, tensor, match, tmp_path, ckpt):
    dst = tmp_path / "bad"
    shutil.copytree(ckpt("llama4"), dst)
    sd = load_file(dst / "model.safetensors")
    sd[key] = tensor
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(SpecMoEError, match=match):
        LLM(dst)
