"""Qwen3-Next and Qwen3.5-MoE (hybrid Gated DeltaNet / gated full attention) against transformers' own classes:
tiny random checkpoints written by save_pretrained (odd sizes, every layer kind: linear and full attention, MoE
and dense), fp32 logits within 1e-4 (batched ragged and single), greedy equal, offloaded == resident bit for bit,
and speculative decoding over the recurrent states: greedy and seeded SpecMoE == plain decoding with drafts both
accepted and rejected, and committing the last verified state instead of the accepted one breaks it."""
from __future__ import annotations

import pytest
import torch

from specmoe import LLM, SamplingParams
from specmoe.models.linear_state import LinearStates

PROMPTS = [[5, 9, 3, 7, 2, 8, 11, 40], [4, 6, 10], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24], [30]]
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
COMMON = dict(vocab_size=96, hidden_size=36, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, num_experts_per_tok=2, max_position_embeddings=256, initializer_range=0.2,
              eos_token_id=None, pad_token_id=None, bos_token_id=None, moe_intermediate_size=20, num_experts=8,
              shared_expert_intermediate_size=28, linear_key_head_dim=10, linear_value_head_dim=6,
              linear_num_key_heads=2, linear_num_value_heads=6, linear_conv_kernel_dim=3)
KINDS = {  # name: (config class, model class, extra config)
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", dict(intermediate_size=44, mlp_only_layers=[1])),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", "Qwen3_5MoeForCausalLM", {}),
    "qwen3_5_moe": ("Qwen3_5MoeConfig", "Qwen3_5MoeForConditionalGeneration", {}),
}


def make_hybrid_checkpoint(kind: str, path, seed: int = 0, echo: float = 0.0, **overrides):
    """A random tiny `kind` model saved by transformers (real key names), its zero-initialised weights (the
    zero-centred norms) drawn at random so that they matter."""
    import transformers as tf
    cfg_cls, model_cls, extra = KINDS[kind]
    kw = {**COMMON, **extra, **{k: list(v) if isinstance(v, tuple) else v for k, v in overrides.items()}}
    if kind == "qwen3_5_moe":
        cfg = getattr(tf, cfg_cls)(text_config=kw, vision_config=dict(
            depth=1, hidden_size=16, intermediate_size=24, num_heads=2, out_hidden_size=kw["hidden_size"],
            patch_size=4, temporal_patch_size=2, num_position_embeddings=16))
    else:
        cfg = getattr(tf, cfg_cls)(**kw)
    torch.manual_seed(seed)
    model = getattr(tf, model_cls)(cfg).eval()
    with torch.no_grad():
        for name, t in model.named_parameters():
            if not t.any():
                t.normal_(0.0, 0.1)
        if echo:  # embeddings scaled by `echo` dominate the residual stream, lm_head = embeddings: the model
            # tends to repeat its input token (a lookup drafter's case)
            emb = model.get_input_embeddings().weight
            emb.mul_(echo)
            model.lm_head.weight.copy_(emb)
    model.save_pretrained(path)
    return path, model


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    made = {}

    def get(kind: str, seed: int = 0, echo: float = 0.0, **overrides):
        key = (kind, seed, echo, tuple(sorted(overrides.items())))
        if key not in made:
            made[key] = make_hybrid_checkpoint(kind, tmp_path_factory.mktemp(kind), seed, echo, **overrides)
        return made[key]
    return get


def max_logit_diff(llm: LLM, hf, prompts) -> float:
    batched = llm.logits(prompts)
    worst = 0.0
    for b, ids in enumerate(prompts):
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        worst = max(worst, (batched[b, :len(ids)] - ref).abs().max().item(),
                    (llm.logits([ids])[0] - ref).abs().max().item())
    return worst


@pytest.mark.parametrize("kind,seed", [("qwen3_next", 1), ("qwen3_next", 2), ("qwen3_5_moe_text", 0),
                                       ("qwen3_5_moe_text", 2), ("qwen3_5_moe", 0)])
def test_logits_and_greedy_match_transformers(kind, seed, ckpts):
    path, hf = ckpts(kind, seed)
    llm = LLM(path, dtype="float32")
    cfg = llm.config
    assert cfg.linear_layers == (0, 1, 2) and cfg.attention_layers == (3,)
    assert (cfg.num_layers - len(cfg.moe_layers) == 1) == (kind == "qwen3_next")  # a dense layer where configured
    assert max_logit_diff(llm, hf, PROMPTS) <= 1e-4
    for ids, out in zip(PROMPTS, llm.generate(PROMPTS, GREEDY)):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              max_new_tokens=10, min_new_tokens=10, do_sample=False)[0, len(ids):].tolist()
        assert out.token_ids == ref


def test_layer_types_and_interval_are_read(ckpts, tmp_path):
    path, hf = ckpts("qwen3_next", 3, num_hidden_layers=5, layer_types=("linear_attention", "full_attention",
                                                                        "linear_attention", "linear_attention",
                                                                        "full_attention"))
    llm = LLM(path, dtype="float32")
    assert llm.config.linear_layers == (0, 2, 3) and llm.config.attention_layers == (1, 4)
    assert llm.runner(1, 8).cache.num_layers == 2  # K/V only for the attention layers
    assert max_logit_diff(llm, hf, PROMPTS[:2]) <= 1e-4


@pytest.mark.parametrize("offload,policy", [("disk", "lru"), ("host", "ondemand")])
def test_offloaded_equals_resident(offload, policy, ckpts):
    path, _ = ckpts("qwen3_next", 0)
    ref = LLM(path)
    ref_logits, ref_tokens = ref.logits(PROMPTS), [o.token_ids for o in ref.generate(PROMPTS, GREEDY)]
    llm = LLM(path, offload=offload, cache_experts=3, cache_policy=policy)
    assert torch.equal(llm.logits(PROMPTS), ref_logits)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == ref_tokens
    assert llm.stats["misses"] > 0


SPEC_PROMPTS = PROMPTS + [[7, 1, 2], [60, 61, 62, 63, 64]]
SPEC_PARAMS = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (14, 3, 11, 14, 7, 14)]


def spec_run(path, **kw):
    llm = LLM(path, **kw)
    return [o.token_ids for o in llm.generate(SPEC_PROMPTS, SPEC_PARAMS)], llm.stats


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5_moe_text"])
def test_self_draft_greedy_equals_plain_greedy(kind, ckpts):
    path, _ = ckpts(kind, 0)
    ref, _ = spec_run(path, decoding="ar")
    out, st = spec_run(path, decoding="specmoe", draft_experts=3, num_draft_tokens=3)
    assert out == ref
    assert st["steps"] > 0 and st["draft_phase_bytes"] == 0
    acc = st["acceptance_per_position"]
    assert 1.0 < st["tokens_per_step"] < 4.0 and 0 < acc[0] < 1, "drafts were accepted and rejected"


def test_ngram_greedy_equals_plain_greedy_with_different_accept_lengths(ckpts):
    path, _ = ckpts("qwen3_next", 0, echo=4.0)  # a model that often repeats: lookups right and wrong
    prompts = [[3, 4, 5, 6] * 4, [9, 8, 7] * 5 + [9], [20, 21, 20, 21, 20, 21, 20], [40, 41, 42, 43, 40, 41]]
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (24, 17, 24, 13)]
    ref = [o.token_ids for o in LLM(path, decoding="ar").generate(prompts, params)]
    llm = LLM(path, decoding="specmoe", drafter="ngram", num_draft_tokens=4, ngram_min=1, ngram_max=3)
    assert [o.token_ids for o in llm.generate(prompts, params)] == ref
    st = llm.stats
    assert st["steps"] > 0 and st["accepted_tokens"] > 0
    assert st["drafters"]["ngram"]["drafted_tokens"] > st["drafters"]["ngram"]["accepted_tokens"], "rejections"


def test_seeded_sampling_specmoe_equals_plain(ckpts):
    path, _ = ckpts("qwen3_5_moe_text", 0)
    params = [SamplingParams(max_tokens=12, temperature=0.8, seed=s, ignore_eos=True) for s in range(len(PROMPTS))]
    ref = [o.token_ids for o in LLM(path, decoding="ar").generate(PROMPTS, params)]
    llm = LLM(path, decoding="specmoe", draft_experts=3, num_draft_tokens=3)
    assert [o.token_ids for o in llm.generate(PROMPTS, params)] == ref
    assert 1.0 < llm.stats["tokens_per_step"] < 4.0


def test_committing_the_last_state_instead_of_the_accepted_one_breaks_equality(ckpts, monkeypatch):
    """Break it on purpose: continue from the state after the last verified token (what a cache that keeps only
    one state would do) instead of the one at the accepted length; the generation then differs."""
    path, _ = ckpts("qwen3_next", 0)
    ref, _ = spec_run(path, decoding="ar")
    out, st = spec_run(path, decoding="specmoe", draft_experts=3, num_draft_tokens=3)
    assert out == ref and st["tokens_per_step"] < 4.0  # some drafts were rejected
    written = {}  # slot -> length after the last token a forward wrote (the last verified position)
    orig_write = LinearStates.write_recurrent

    def spy(self, layer, slots, lengths, state, keep):
        for s, n, k in zip(slots.tolist(), lengths.tolist(), keep.tolist()):
            if k:
                written[s] = n
        return orig_write(self, layer, slots, lengths, state, keep)

    def last_row(self, lengths):
        return torch.tensor([written.get(s, 0) for s in range(len(lengths))], device=lengths.device) % self.ring

    monkeypatch.setattr(LinearStates, "write_recurrent", spy)
    monkeypatch.setattr(LinearStates, "read", _read_with(last_row))
    broken, _ = spec_run(path, decoding="specmoe", draft_experts=3, num_draft_tokens=3)
    assert broken != ref


def _read_with(row_of):
    """LinearStates.read with the ring row chosen by row_of(self, lengths-of-all-slots) instead of the commit."""
    def read(self, layer, slots, start):
        lengths = torch.zeros(self.max_batch, dtype=torch.long, device=start.device)
        lengths[slots] = start
        r = row_of(self, lengths)[slots]
        fresh = start == 0
        return (self.conv[layer][slots, r].masked_fill(fresh[:, None, None], 0),
                self.rec[layer][slots, r].masked_fill(fresh[:, None, None, None], 0))
    return read


def test_draft_tree_falls_back_to_chains(ckpts):
    path, _ = ckpts("qwen3_next", 0)
    ref, _ = spec_run(path, decoding="ar")
    out, st = spec_run(path, decoding="specmoe", draft_experts=3, num_draft_tokens=3, draft_tree=True,
                       draft_tree_width=3)
    assert out == ref
    assert "draft_tree" not in st and st["steps"] > 0  # verified as chains


def test_memory_counts_the_constant_linear_state(ckpts):
    path, _ = ckpts("qwen3_next", 0)
    llm = LLM(path, decoding="specmoe", draft_experts=3, num_draft_tokens=3)
    llm.generate(PROMPTS, GREEDY)
    mem = llm.stats["memory"]
    cfg = llm.config
    la = cfg.linear_attention
    ring = 3 + 1 + 1  # lookahead γ + 1, plus the committed row
    per_slot = 3 * ring * (la.num_v_heads * la.k_head_dim * la.v_head_dim * 4 + la.conv_dim * (la.conv_kernel - 1) * 4)
    assert mem["kv_cache_linear_state"] == per_slot * len(PROMPTS)
    assert mem["kv_cache"] > mem["kv_cache_linear_state"] > 0
