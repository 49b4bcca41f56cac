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
from tests.hf_compare import hf_greedy, max_logit_diff

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
        ref = hf_greedy(hf, ids, 10)
        assert out.token_ids == ref


def test_layer_types_and_interval_are_read(ckpts, tmp_path):
    path, hf = ckpts("qwen3_next", 3, num_hidden_layers=5, layer_types=("linear_attention", "full_attention",
                                                                        "linear_attention", "linear_attention",
                                                                        "full_attention"))
    llm = LLM(path, dtype="float32")
    assert llm.config.linear_layers == (0, 2, 3) and llm.config.attention_layers == (1, 4)
    assert llm.runner(1, 8).cache.num_layers == 2  # K/V only for the attention layers
    assert max_logit_diff(llm, hf, PROMPTS[:2]) <= 1e-4


@pytest.mark.parametrize("offload,policy", [("disk", "lru"), ("host", "ondemand"), ("host", "lfu")])
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
def test_self_draft_greedy_equals_plain_greedy(kind, ckpts, monkeypatch):
    from specmoe.decoding.strategies.speculative import SpeculativeDecoder
    path, _ = ckpts(kind, 0)
    ref, _ = spec_run(path, decoding="ar")
    emitted = []  # per verification: the tokens each row commits
    commit = SpeculativeDecoder.commit
    monkeypatch.setattr(SpeculativeDecoder, "commit", lambda self, seqs, paths, out, *a: (
        emitted.append([len(t) for t in out]), commit(self, seqs, paths, out, *a))[1])
    out, st = spec_run(path, decoding="specmoe", draft_experts=3, num_draft_tokens=3)
    assert out == ref
    assert st["steps"] > 0 and st["draft_phase_bytes"] == 0
    acc = st["acceptance_per_position"]
    assert 1.0 < st["tokens_per_step"] < 4.0 and 0 < acc[0] < 1, "drafts were accepted and rejected"
    assert any(len(set(n)) > 1 for n in emitted if len(n) > 1), "rows of one batch accepted different lengths"


def test_self_draft_over_the_disk_tier_equals_resident_plain(ckpts):
    path, _ = ckpts("qwen3_5_moe_text", 0)
    ref, _ = spec_run(path, decoding="ar")
    out, st = spec_run(path, decoding="specmoe", draft_experts=3, num_draft_tokens=3, offload="disk",
                       cache_experts=5, cache_policy="lru")
    assert out == ref and st["misses"] > 0 and 1.0 < st["tokens_per_step"] < 4.0


def test_verify_expert_budget_runs_on_the_softmax_router(ckpts):
    path, _ = ckpts("qwen3_next", 0)
    _, st = spec_run(path, decoding="specmoe", draft_experts=3, num_draft_tokens=3, verify_expert_budget=4)
    assert st["budget_lossy"] and st["budget_rerouted_share"] > 0


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

    def spy(self, layer, slots, lengths, state, keep=None):
        for s, n, k in zip(slots.tolist(), lengths.tolist(), [True] * len(slots) if keep is None else keep.tolist()):
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
    la = LLM(path).config.linear_attention  # and the states' ring is a chain's: γ + 2 rows, not 3γ + 2
    per_row = la.num_v_heads * la.k_head_dim * la.v_head_dim * 4 + la.conv_dim * (la.conv_kernel - 1) * 4
    assert st["memory"]["kv_cache_linear_state"] == 3 * (3 + 2) * per_row * len(SPEC_PROMPTS)


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
    # what the engine's memory checks count per sequence (model_cache_bytes) is what a cache allocates
    from specmoe.models.kv_cache import make_cache, model_cache_bytes
    c = make_cache(cfg, max_batch=2, max_seq=256, dtype=torch.float32, ring=ring)
    tensors = [c.k, c.v] + c.states.rec + c.states.conv
    assert c.nbytes == model_cache_bytes(cfg, torch.float32, 2, 256, ring) == sum(
        t.numel() * t.element_size() for t in tensors)


@pytest.mark.parametrize("kind,T", [("qwen3_next", 11), ("qwen3_5_moe_text", 11), ("qwen3_next", 150)])
def test_deltanet_layer_prefill_and_steps_match_transformers(kind, T, ckpts):
    """One Gated DeltaNet layer on the same input as transformers' (its torch chunked path): a whole-prompt
    forward (150 tokens: the chunked form), and the same tokens one forward at a time through the cache's states
    (the recurrent step)."""
    from specmoe.models.decoder import BatchView
    path, hf = ckpts(kind, 0)
    llm = LLM(path, dtype="float32")
    x = torch.randn(1, T, llm.config.hidden_size, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = hf.model.layers[1].linear_attn(x)[0]  # [T, D]
    layer = llm.model.layers[1].attn
    cache = llm.runner(1, 256).cache

    def run(start, xs):
        n = xs.shape[0]
        bv = BatchView(slots=None, positions=torch.arange(start, start + n)[None], contiguous=slice(0, 1),
                       key_len=start + n)
        with torch.no_grad():
            return layer(xs, None, None, None, cache, llm.config.cache_index(1), bv)
    whole = run(0, x[0])
    steps = torch.cat([run(t, x[0, t:t + 1]) for t in range(T)])
    assert (whole - ref).abs().max() <= 1e-5 and (steps - ref).abs().max() <= 1e-5


def test_inspect_shows_layer_kinds(ckpts):
    from specmoe.cli.inspect import describe
    info = describe(ckpts("qwen3_next", 0)[0])
    assert info["attention"] == "hybrid" and info["linear_attention_layers"] == 3
    assert info["layer_kinds"] == ["moe linear_attention", "dense linear_attention", "moe linear_attention", "moe"]
    assert info["not_loaded"] == "mtp.*"
    mm = describe(ckpts("qwen3_5_moe", 0)[0])  # the multimodal release: its language model, qwen3_5_moe_text
    assert mm["family"] == "qwen3_5_moe_text" and mm["not_loaded"] == "mtp.*, model.visual.*"
    assert mm["layer_kinds"] == ["moe linear_attention"] * 3 + ["moe"]


def test_auto_and_continuous_batching_equal_plain(ckpts):
    """`auto` (its cost model calibrates on the hybrid model) and slots reused by later requests (max_batch 2 <
    6 requests: a slot's states restart from zeros for its next sequence)."""
    path, _ = ckpts("qwen3_next", 0)
    ref, _ = spec_run(path, decoding="ar")
    out, st = spec_run(path, decoding="auto", draft_experts=3, num_draft_tokens=3)
    assert out == ref
    out, st = spec_run(path, decoding="specmoe", draft_experts=3, num_draft_tokens=3, max_batch=2)
    assert out == ref and 1.0 < st["tokens_per_step"] < 4.0


def test_eagle_drafter_equals_plain(ckpts, tmp_path):
    """A random EAGLE-1 head over the hybrid target: drafts proposed, verified and (mostly) rejected; output
    equal to plain greedy."""
    import json

    from safetensors.torch import save_file
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    path, _ = ckpts("qwen3_next", 0)
    D = COMMON["hidden_size"]
    cfg = LlamaConfig(hidden_size=D, intermediate_size=40, num_attention_heads=3, num_key_value_heads=1,
                      num_hidden_layers=1, vocab_size=COMMON["vocab_size"], max_position_embeddings=256)
    torch.manual_seed(0)
    layer = LlamaDecoderLayer(cfg, 0)
    sd = {f"layers.0.{k}": v for k, v in layer.state_dict().items() if "input_layernorm" not in k}
    sd.update({"fc.weight": torch.randn(D, 2 * D) * 0.1, "fc.bias": torch.zeros(D)})
    head = tmp_path / "eagle"
    head.mkdir()
    save_file(sd, str(head / "model.safetensors"))
    (head / "config.json").write_text(json.dumps(json.loads(cfg.to_json_string())))
    ref, _ = spec_run(path, decoding="ar")
    out, st = spec_run(path, decoding="specmoe", drafter="eagle", eagle_head=str(head), num_draft_tokens=3)
    assert out == ref
    assert st["drafters"]["eagle"]["drafted_tokens"] > 0 and st["steps"] > 0


def test_fused_expert_layout_reads_like_per_expert(ckpts, tmp_path):
    """Qwen3.5 as published stores each layer's experts fused (transformers' gate_up_proj [E, 2I, D], gate rows
    first, and down_proj [E, D, I]); save_pretrained writes them per expert. Both read the same, every tier."""
    import shutil

    from safetensors.torch import load_file, save_file
    src, _ = ckpts("qwen3_5_moe", 0)
    dst = tmp_path / "fused"
    shutil.copytree(src, dst)
    sd = load_file(str(dst / "model.safetensors"))
    E = COMMON["num_experts"]
    for layer in range(COMMON["num_hidden_layers"]):
        base = f"model.language_model.layers.{layer}.mlp.experts"
        gate_up = [torch.cat([sd.pop(f"{base}.{e}.gate_proj.weight"), sd.pop(f"{base}.{e}.up_proj.weight")])
                   for e in range(E)]
        sd[f"{base}.gate_up_proj"] = torch.stack(gate_up)
        sd[f"{base}.down_proj"] = torch.stack([sd.pop(f"{base}.{e}.down_proj.weight") for e in range(E)])
    save_file(sd, str(dst / "model.safetensors"), metadata={"format": "pt"})
    ref = LLM(src)
    fused = LLM(dst)
    assert fused.config.fused_experts and not ref.config.fused_experts
    assert torch.equal(fused.logits(PROMPTS), ref.logits(PROMPTS))
    disk = LLM(dst, offload="disk", cache_experts=3, cache_policy="lru")
    assert torch.equal(disk.logits(PROMPTS), ref.logits(PROMPTS)) and disk.stats["misses"] > 0


def test_multimodal_releases_read_the_head_tie_where_the_head_is():
    """One text_config reader for both multimodal releases: Qwen3.5's LM head is the top-level module's (its
    tie_word_embeddings wins), Llama-4's belongs to the nested language model (text_config's wins), as transformers
    ties them; the weights' prefixes and the skipped parts come from the release, the MTP module from the text
    family."""
    import transformers as tf

    from specmoe.families import read_config
    from tests.tiny_llama4_minimax import LLAMA4
    q = read_config(tf.Qwen3_5MoeConfig(text_config=dict(COMMON), tie_word_embeddings=True).to_dict())
    assert (q.model_type, q.tie_word_embeddings, q.weight_prefix, q.head_prefix, q.skipped_prefixes) == (
        "qwen3_5_moe_text", True, "model.language_model.", "", ("mtp.", "model.visual."))
    llama = read_config(tf.Llama4Config(text_config={**LLAMA4, "tie_word_embeddings": True}).to_dict())
    assert (llama.model_type, llama.tie_word_embeddings, llama.weight_prefix, llama.head_prefix) == (
        "llama4_text", True, "language_model.model.", "language_model.")


@pytest.mark.parametrize("kind,change,match", [
    ("qwen3_next", {"layer_types": ["linear_attention", "attention", "linear_attention", "full_attention"]},
     "layer_types must be a list of 4 entries"),
    ("qwen3_next", {"layer_types": ["linear_attention"] * 4}, "at least one full_attention"),
    ("qwen3_next", {"linear_num_value_heads": 5}, "linear_num_value_heads must be a multiple"),
    ("qwen3_5_moe", {"text_config": None}, "text_config must be an object"),
])
def test_bad_hybrid_fields_are_one_clear_error(kind, change, match, ckpts, tmp_path):
    import json
    import shutil

    from specmoe.errors import CheckpointError
    src, _ = ckpts(kind, 0)
    dst = tmp_path / "bad"
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**cfg, **change}))
    with pytest.raises(CheckpointError, match=match):
        LLM(dst)


def hf_rounding(hf, prompts) -> float:
    """Transformers' own fp32 rounding over these prompts: the largest |its fp32 logits − its fp64 logits|."""
    import copy
    hf64 = copy.deepcopy(hf).double()
    hf64.set_experts_implementation("eager")  # the grouped-mm experts take no fp64
    with torch.no_grad():
        return max((hf(torch.tensor([ids])).logits[0].double() - hf64(torch.tensor([ids])).logits[0]).abs().max().item()
                   for ids in prompts)


def test_long_prompts_take_the_chunked_form_and_match(ckpts):
    """Prefill forwards of at least a chunk (64 tokens) run the chunked form (ragged rows too: padding leaves a
    row's state as it is), keeping each row's state after its last token: logits against transformers (over a
    long prompt this random model amplifies rounding: ours and transformers' fp32 logits may differ by twice
    transformers' own fp32 error against its fp64 run, 6e-4 at 150 tokens on an AVX-512 machine; a wrong state is
    off by O(1)), greedy equal, and SpecMoE after such a prefill equal to plain."""
    from specmoe.models import deltanet
    path, hf = ckpts("qwen3_5_moe_text", 0)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (150, 70, 9)]
    calls = []
    orig = deltanet.chunked
    deltanet.chunked = lambda *a, **k: calls.append(a[0].shape[1]) or orig(*a, **k)
    try:
        llm = LLM(path, dtype="float32")
        assert max_logit_diff(llm, hf, prompts) <= max(1e-4, 2 * hf_rounding(hf, prompts))
        assert {150, 70} <= set(calls)  # prefill forwards (single and ragged batch) take the chunked form
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        for ids, out in zip(prompts, llm.generate(prompts, params)):
            ref = hf_greedy(hf, ids, 8)
            assert out.token_ids == ref
        spec = LLM(path, decoding="specmoe", draft_experts=3, num_draft_tokens=3)
        plain = [o.token_ids for o in llm.generate(prompts, params)]
        before = len(calls)
        assert [o.token_ids for o in spec.generate(prompts, params)] == plain
        assert len(calls) > before and 1.0 < spec.stats["tokens_per_step"] < 4.0
    finally:
        deltanet.chunked = orig


def test_a_rows_bits_do_not_depend_on_its_batch_in_bf16(ckpts):
    """Each row picks the chunked or the recurrent form by its own length, so a prompt's logits are the same bits
    alone and in a ragged batch with longer and shorter prompts (bf16; fp32 needs `deterministic`, whose
    shared-expert gate is not batch-invariant yet for any Qwen2-MoE-style family)."""
    path, _ = ckpts("qwen3_next", 0)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (5, 90, 17, 1, 70, 3)]
    llm = LLM(path, dtype="bfloat16")
    batch = llm.logits(prompts)
    for b, p in enumerate(prompts):
        assert torch.equal(llm.logits([p])[0], batch[b, :len(p)])


def test_requests_joining_a_running_batch_equal_plain(ckpts, monkeypatch):
    """Serving: the engine core sized for serving (slots grow on demand), requests added while others decode
    (each new sequence's states start from zeros in its slot, the cache growing keeps the running ones')."""
    from specmoe.engine.core import Request
    path, _ = ckpts("qwen3_next", 0)
    ref, _ = spec_run(path, decoding="ar")
    from specmoe.engine import llm as llm_module
    monkeypatch.setattr(llm_module, "SERVE_INITIAL_SLOTS", 1)  # the cache grows (1 → 2 → 4 slots) mid-run
    llm = LLM(path, decoding="specmoe", draft_experts=3, num_draft_tokens=3)
    with llm.engine() as core:
        reqs = [core.add(Request(prompt_ids=p, params=sp)) for p, sp in zip(SPEC_PROMPTS[:2], SPEC_PARAMS[:2])]
        for p, sp in zip(SPEC_PROMPTS[2:], SPEC_PARAMS[2:]):
            core.step()
            core.step()
            reqs.append(core.add(Request(prompt_ids=p, params=sp)))
        while core.has_work:
            core.step()
        grown = core.cache.max_batch
    assert [r.output_ids for r in reqs] == ref
    assert grown >= 4 and llm.stats["steps"] > 0 and llm.stats["tokens_per_step"] > 1.0
