"""GLM-4 MoE, DeepSeek-V2, DeepSeek-V3 and GPT-OSS as deltas of the generic decoder, against transformers' own
implementation (tiny random checkpoints with odd sizes, written by transformers with real key names):
logits within 1e-4 in fp32 (batched ragged and single), greedy equal, offloaded == resident bit for bit,
SpecMoE greedy == plain greedy, and each family's own parts (MLA's latent cache, expert biases in the
draft, MTP keys, config checks)."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specmoe import LLM, SamplingParams
from specmoe.errors import CheckpointError
from tests.conftest import DELTA_FAMILIES, make_tiny_checkpoint
from tests.hf_compare import hf_greedy, max_logit_diff

PROMPTS = [[5, 9, 3, 7, 2, 8, 11, 40], [4, 6, 10], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24], [30]]
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield




@pytest.mark.parametrize("family", DELTA_FAMILIES)
def test_logits_and_greedy_match_transformers(family, tiny_ckpt, hf_model):
    path = tiny_ckpt(family)
    hf, llm = hf_model(path), LLM(path, dtype="float32")
    assert max_logit_diff(llm, hf, PROMPTS) <= 1e-4
    outs = llm.generate(PROMPTS, GREEDY)
    for ids, out in zip(PROMPTS, outs):
        ref = hf_greedy(hf, ids, 10)
        assert out.token_ids == ref


@pytest.mark.parametrize("family", DELTA_FAMILIES)
def test_offloaded_disk_tier_equals_resident(family, tiny_ckpt):
    path = tiny_ckpt(family)
    ref = LLM(path)
    ref_logits, ref_tokens = ref.logits(PROMPTS), [o.token_ids for o in ref.generate(PROMPTS, GREEDY)]
    llm = LLM(path, offload="disk", cache_experts=3, cache_policy="lru")
    assert torch.equal(llm.logits(PROMPTS), ref_logits)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == ref_tokens
    s = llm.stats
    assert s["offload"] == "disk" and s["misses"] > 0 and s["bytes_moved"] >= s["misses"] * s["bytes_per_expert"]
    assert s["bytes_per_expert"] == llm.config.expert_numel * 4


@pytest.mark.parametrize("family,substitution", [(f, "affinity") for f in DELTA_FAMILIES] + [("glm4_moe", "mask")])
def test_specmoe_greedy_equals_plain_greedy(family, substitution, tiny_ckpt):
    path = tiny_ckpt(family)
    ps = PROMPTS + [[7, 1, 2], [60, 61, 62, 63, 64]]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (12, 3, 9, 12, 7, 12)]
    ref = [o.token_ids for o in LLM(path, decoding="ar").generate(ps, params)]
    llm = LLM(path, decoding="specmoe", draft_experts=3, num_draft_tokens=3, substitution=substitution)
    assert [o.token_ids for o in llm.generate(ps, params)] == ref
    st = llm.stats
    assert st["steps"] > 0 and st["draft_phase_bytes"] == 0
    assert 1.0 < st["tokens_per_step"] < 4.0, "drafts were accepted and rejected"


@pytest.mark.parametrize("family", DELTA_FAMILIES)
def test_draft_holding_every_expert_is_the_target(family, tiny_ckpt):
    """With all E experts as draft experts (affinity maps each expert onto itself) the draft computes the
    target's experts (biases and the clamped SwiGLU included) from its own stacks: every draft is accepted."""
    path = tiny_ckpt(family)
    llm = LLM(path, decoding="specmoe", draft_experts=8, num_draft_tokens=3, substitution="affinity")
    llm.generate(PROMPTS, GREEDY)
    assert llm.stats["acceptance_per_position"] == [1.0, 1.0, 1.0]


def test_mla_caches_the_latent_not_keys_and_values(tiny_ckpt):
    """DeepSeek's cache holds [c; k_rope] per position (kv_lora_rank + qk_rope_head_dim values), one tensor."""
    llm = LLM(tiny_ckpt("deepseek_v3"), dtype="float32")
    llm.generate(PROMPTS[:2], GREEDY)
    cache, ml = llm._cache, llm.config.mla
    L, B, H, S, C = cache.k.shape  # head-major: [layers, slots, heads, positions, dims]
    assert cache.v is None and (H, C) == (1, ml.kv_lora_rank + ml.qk_rope_head_dim)
    assert cache.nbytes == L * B * S * (ml.kv_lora_rank + ml.qk_rope_head_dim) * 4
    full = L * B * S * llm.config.num_heads * (ml.qk_nope_head_dim + ml.qk_rope_head_dim + ml.v_head_dim) * 4
    assert cache.nbytes * 4 < full  # what caching expanded per-head K and V would take


def test_kimi_k2_reads_as_deepseek_v3(tmp_path, tiny_ckpt, hf_model):
    """Kimi-K2 checkpoints carry model_type "kimi_k2" with DeepSeek-V3's architecture and key names."""
    src = tiny_ckpt("deepseek_v3")
    dst = tmp_path / "kimi"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "model_type": "kimi_k2"}))
    llm = LLM(dst, dtype="float32")
    assert llm.config.model_type == "deepseek_v3" and llm.config.mla is not None
    assert max_logit_diff(llm, hf_model(src), PROMPTS[:2]) <= 1e-4


def test_routers_match_transformers(tiny_ckpt):
    """The sigmoid group-limited router (GLM-4, DeepSeek-V3, with a correction bias), DeepSeek-V2's
    group-limited softmax and GPT-OSS's top-k softmax, as pure functions, against transformers' router modules."""
    from transformers import AutoConfig
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter
    from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeTopkRouter
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter

    from specmoe.families import load_config
    from specmoe.models.routers import route
    torch.manual_seed(0)
    for family, cls in (("glm4_moe", Glm4MoeTopkRouter), ("deepseek_v2", DeepseekV2TopkRouter),
                        ("deepseek_v3", DeepseekV3TopkRouter), ("gpt_oss", GptOssTopKRouter)):
        path = tiny_ckpt(family)
        cfg, ours = AutoConfig.from_pretrained(path), load_config(path)
        ref = cls(cfg)
        with torch.no_grad():
            for t in ref.state_dict().values():
                t.normal_(0.0, 0.5)
        x = torch.randn(33, cfg.hidden_size)
        _, ref_w, ref_ids = ref(x)
        bias = ref.e_score_correction_bias if ours.score_correction_bias else None
        w, ids = route(family, torch.nn.functional.linear(x, ref.weight, getattr(ref, "bias", None)),
                       top_k=ours.top_k, norm_topk_prob=ours.norm_topk_prob, correction_bias=bias,
                       n_group=ours.n_group, topk_group=ours.topk_group, scale=ours.routed_scaling_factor)
        ids_s, order = ids.sort(dim=-1)
        ref_s, ref_order = ref_ids.sort(dim=-1)
        assert torch.equal(ids_s, ref_s), family
        assert torch.allclose(w.gather(1, order), ref_w.float().gather(1, ref_order), atol=1e-6), family
        if ours.n_group > 1:  # the group limit (and the correction bias) change the picks here
            plain = torch.nn.functional.linear(x, ref.weight).topk(ours.top_k, dim=-1)[1].sort(-1)[0]
            assert not torch.equal(plain, ids_s), family


def test_bf16_checkpoint_keeps_the_sigmoid_router_in_fp32(tmp_path):
    path = make_tiny_checkpoint("glm4_moe", tmp_path / "bf16", dtype=torch.bfloat16)
    llm = LLM(path, dtype="bfloat16")  # (auto computes in fp32 where this CPU's bf16 matmul is slow)
    assert llm.dtype == torch.bfloat16
    mlp = llm.model.layers[1].mlp
    assert mlp.router.weight.dtype == torch.float32 and mlp.correction_bias.dtype == torch.float32
    assert llm.model.layers[1].attn.q_proj.weight.dtype == torch.bfloat16
    assert len(llm.generate([PROMPTS[0]], GREEDY)[0].token_ids) == 10


def test_mtp_layers_are_ignored_and_other_extra_keys_refused(tmp_path, tiny_ckpt):
    """GLM-4 / DeepSeek-V3 checkpoints carry num_nextn_predict_layers multi-token-prediction layers after the
    last decoder layer: not used, not an error. The same key is unexpected when the config declares none."""
    dst = tmp_path / "mtp"
    shutil.copytree(tiny_ckpt("deepseek_v3"), dst)
    sd = load_file(dst / "model.safetensors")
    sd["model.layers.3.eh_proj.weight"] = torch.zeros(40, 80)
    save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="unexpected tensor.*model.layers.3.eh_proj.weight"):
        LLM(dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    assert LLM(dst, dtype="float32").logits([PROMPTS[1]]).shape == (1, 3, 96)


@pytest.mark.parametrize("family,change,match", [
    ("glm4_moe", {"n_group": 3}, "n_group must be a divisor of the 8 routed experts"),
    ("glm4_moe", {"topk_group": 5}, "topk_group must be an integer in"),
    ("glm4_moe", {"n_group": 4, "topk_group": 1}, "topk_group must be .* at least num_experts_per_tok"),
    ("glm4_moe", {"first_k_dense_replace": 3}, "first_k_dense_replace must be an integer in"),
    ("deepseek_v3", {"kv_lora_rank": 0}, "kv_lora_rank must be an integer >= 1"),
    ("gpt_oss", {"layer_types": ["full_attention"]}, "layer_types must be a list of 3 entries"),
    ("gpt_oss", {"swiglu_limit": -1}, "swiglu_limit must be a finite number > 0"),
])
def test_bad_family_fields_are_one_clear_error(family, change, match, tmp_path, tiny_ckpt):
    dst = tmp_path / "bad"
    shutil.copytree(tiny_ckpt(family), dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(CheckpointError, match=match):
        LLM(dst)


@pytest.mark.parametrize("family", DELTA_FAMILIES)
def test_inspect_describes_the_family(family, tiny_ckpt):
    from specmoe.cli.inspect import describe
    info = describe(tiny_ckpt(family))
    cfg = LLM(tiny_ckpt(family)).config
    assert info["family"] == family
    assert info["attention"] == {"glm4_moe": "gqa", "deepseek_v2": "mla", "deepseek_v3": "mla",
                                 "gpt_oss": "sinks"}[family]
    assert info["dense_layers"] == (0 if family in ("gpt_oss", "deepseek_v2") else 1)
    assert info["shared_experts"] == (family != "gpt_oss")
    assert info["bytes_per_expert"] == cfg.expert_numel * 4  # GPT-OSS: weights and biases of one expert
