"""The eagle drafter end to end on the demo model with its shipped head (fp32): greedy speculation equals
plain greedy decoding at batch 1, 7 (ragged) and 64 with drafts both accepted and rejected; every proposal
equals a from-scratch recomputation (the target's features over the whole history, the head over every entry
and the drafted chain, no caches kept between steps); seeded sampled rows equal plain seeded decoding;
unseeded sampled rows draw from the head's q; option and head-path errors."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from specmoe import LLM, SamplingParams
from specmoe.decoding.drafters.eagle import EagleDrafter
from specmoe.errors import CheckpointError, InputError
from specmoe.models.decoder import BatchView
from specmoe.models.kv_cache import KVCache
from specmoe.models.moe import ForwardContext
from tests.decoding.eagle_cases import BATCHES, PROMPTS, prompts


@pytest.fixture(scope="module")
def ar_llm():
    return LLM(dtype="float32", threads=1)


@pytest.mark.parametrize("batch,gamma", [(1, 4), (7, 3), (64, 4)])
def test_eagle_greedy_equals_plain_greedy(ar_llm, batch, gamma):
    ps, sp = BATCHES[batch]
    ref = [o.token_ids for o in ar_llm.generate(ps, sp)]
    llm = LLM(dtype="float32", threads=1, decoding="specmoe", drafter="eagle", num_draft_tokens=gamma)
    got = [o.token_ids for o in llm.generate(ps, sp)]
    assert got == ref
    s = llm.stats
    assert s["drafter"] == "eagle" and s["eagle_version"] == 1 and s["eagle_head"].endswith("specmoe-tiny-moe-eagle")
    assert s["drafted_tokens"] > 0 and s["eagle_head_forwards"] > 0
    assert 0 < s["accepted_tokens"] < s["drafted_tokens"], "drafts must be both accepted and rejected"
    assert s["draft_phase_bytes"] == 0
    assert 1.0 < s["tokens_per_step"] <= gamma + 1


def target_features(llm: LLM, ids: list[int]) -> torch.Tensor:
    """The target's final normed hidden state at every position of `ids`, one fresh forward: [T, D]."""
    L, T = llm.config.num_layers, len(ids)
    cache = KVCache(num_layers=L, max_batch=1, max_seq=T, num_kv_heads=llm.config.num_kv_heads,
                    head_dim=llm.config.head_dim, dtype=torch.float32)
    bv = BatchView(slots=torch.arange(1), positions=torch.arange(T)[None], contiguous=slice(0, 1), key_len=T)
    ctx = ForwardContext(provider=llm.store, capture_hidden=(L,))
    llm.model(torch.tensor([ids]), cache, bv, ctx)
    return ctx.hidden[L][0]


def head_outputs(head, emb_w, tokens: list[int], feats: torch.Tensor) -> torch.Tensor:
    """The head over entries 0..n-1 from scratch (a fresh cache): [n, D]."""
    n = len(tokens)
    kv = head.new_cache(1, n, torch.float32, "cpu")
    bv = BatchView(slots=torch.arange(1), positions=torch.arange(n)[None], contiguous=slice(0, 1), key_len=n)
    return head(F.embedding(torch.tensor([tokens]), emb_w), feats[None], kv, bv)[0]


def test_eagle_proposals_equal_a_from_scratch_recomputation(monkeypatch):
    seen = []
    orig = EagleDrafter.propose_tree

    def spy(self, seqs, gammas, width, noise, hook=None):
        trees = orig(self, seqs, gammas, width, noise, hook)
        seen.extend((s.prompt_ids + s.output_ids, t.tokens) for t, s in zip(trees, seqs))
        return trees
    monkeypatch.setattr(EagleDrafter, "propose_tree", spy)
    llm = LLM(dtype="float32", threads=1, decoding="specmoe", drafter="eagle", num_draft_tokens=3)
    ps = prompts(3)
    llm.generate(ps, [SamplingParams(max_tokens=m, ignore_eos=True) for m in (12, 5, 9)])
    head = next(v for k, v in llm.draft_memo.items() if k[0] == "eagle")
    emb_w, checked = llm.model.embed.weight, 0
    with torch.inference_mode():
        for ids, drafts in seen[::2]:  # every other proposal: enough, and cheaper
            if not drafts:
                continue
            feats = target_features(llm, ids[:-1])  # positions 0..L-1 (ids[-1] is the pending token)
            toks = ids[1:]  # entry t reads token t+1
            for d in drafts:
                out = head_outputs(head, emb_w, toks, feats)
                logits = head.logits(out[-1], emb_w)
                assert logits[d] >= logits.max() - 1e-4, "the drafter's token is the head's argmax"
                toks, feats = toks + [d], torch.cat((feats, out[-1:]))
                checked += 1
    assert checked >= 10


def test_eagle_sampled_rows(ar_llm):
    ps = prompts(3)
    sp = [SamplingParams(max_tokens=12, temperature=0.8, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    ref = [o.token_ids for o in ar_llm.generate(ps, sp)]
    llm = LLM(dtype="float32", threads=1, decoding="specmoe", drafter="eagle", num_draft_tokens=3)
    assert [o.token_ids for o in llm.generate(ps, sp)] == ref  # seeded: the coupled rule keeps the target's sample
    assert llm.stats["drafted_tokens"] > 0
    # unseeded: drafts drawn from the head's q go through rejection sampling
    qs = []
    orig = EagleDrafter.propose_tree

    def spy(self, seqs, gammas, width, noise, hook=None):
        trees = orig(self, seqs, gammas, width, noise, hook)
        qs.extend(t.q for t in trees)
        return trees
    EagleDrafter.propose_tree = spy
    try:
        outs = llm.generate(ps, SamplingParams(max_tokens=10, temperature=1.0, ignore_eos=True))
    finally:
        EagleDrafter.propose_tree = orig
    assert all(len(o.token_ids) == 10 for o in outs)
    q = next(q for q in qs if q is not None)
    assert torch.allclose(q.sum(-1), torch.ones(1))


def test_eagle_options_and_head_errors(tmp_path):
    with pytest.raises(InputError, match="eagle_head applies"):
        LLM(drafter="ngram", eagle_head=str(tmp_path))
    with pytest.raises(InputError, match="eagle_draft_vocab applies"):
        LLM(decoding="auto", drafter="self", eagle_draft_vocab=4)
    llm = LLM(dtype="float32", threads=1, decoding="specmoe", drafter="eagle", eagle_head=str(tmp_path / "none"))
    with pytest.raises(CheckpointError, match="not found"):
        llm.generate(prompts(1), SamplingParams(max_tokens=2))


def test_docs_eagle_table_is_generated_from_the_results_file():
    import importlib.util
    repo = PROMPTS.parents[1]
    spec = importlib.util.spec_from_file_location("eagle_bench", repo / "benchmarks" / "eagle_bench.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    res = json.loads((repo / "benchmarks" / "results" / "eagle_bench.json").read_text())
    text = bench.DOC.read_text()  # docs/speculation.md
    i, j = text.index(bench.BEGIN), text.index(bench.END) + len(bench.END)
    assert text[i:j] == bench.readme_block(res), \
        "docs/speculation.md's eagle table is stale: run benchmarks/eagle_bench.py --readme-only"
    assert all(r["equal_to_ar"] for r in res["rows"]), "a lossless drafter diverged from plain decoding"
    res["rows"][0]["tokens_per_s"] += 1.0  # a changed figure changes the block
    assert text[i:j] != bench.readme_block(res)


def test_eagle3_head_drafts_from_three_target_layers(tmp_path, ar_llm):
    """A random EAGLE-3 head for the demo model (fc over three target layers' states, reduced draft vocabulary):
    proposals come from its draft vocabulary only, and greedy output still equals plain decoding."""
    from specmoe.models.eagle import EagleConfig, EagleHead, save_eagle_head
    mc = ar_llm.config
    Vd = 512
    hc = EagleConfig(version=3, hidden_size=mc.hidden_size, intermediate_size=128, num_layers=1, num_heads=4,
                     num_kv_heads=2, head_dim=64, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=mc.vocab_size,
                     max_position_embeddings=1024, target_hidden_size=mc.hidden_size, draft_vocab_size=Vd,
                     fc_bias=False, aux_layers=(1, 3, 4))
    torch.manual_seed(0)
    head = EagleHead(hc)
    ids = torch.randperm(mc.vocab_size)[:Vd].sort().values
    head.d2t.copy_(ids - torch.arange(Vd))
    save_eagle_head(head, tmp_path)
    ps, sp = prompts(2), SamplingParams(max_tokens=10, ignore_eos=True)
    ref = [o.token_ids for o in ar_llm.generate(ps, sp)]
    seen = []
    orig = EagleDrafter.propose_tree

    def spy(self, seqs, gammas, width, noise, hook=None):
        trees = orig(self, seqs, gammas, width, noise, hook)
        seen.extend(torch.tensor(t.tokens, dtype=torch.long) for t in trees)
        return trees
    EagleDrafter.propose_tree = spy
    try:
        llm = LLM(dtype="float32", threads=1, decoding="specmoe", drafter="eagle", eagle_head=str(tmp_path))
        assert [o.token_ids for o in llm.generate(ps, sp)] == ref
    finally:
        EagleDrafter.propose_tree = orig
    s = llm.stats
    assert s["eagle_version"] == 3 and s["drafted_tokens"] > 0
    drafted = torch.cat([d.reshape(-1) for d in seen])
    assert torch.isin(drafted, ids).all(), "EAGLE-3 proposes only target ids of its draft vocabulary"
    d = next(v for k, v in llm.draft_memo.items() if k[0] == "eagle")
    assert d.hc.target_layers(mc.num_layers) == (1, 3, 4)
