"""MoE-Spec verification budget (lossy, opt-in): the allowed set is the K experts of most routing mass plus
every token's top-1, tokens re-route inside it, a budget that covers every routed expert changes nothing
(greedy equals plain greedy), a small one re-routes and shrinks the per-layer union."""
from __future__ import annotations

import pytest
import torch

from specmoe import LLM, SamplingParams
from specmoe.decoding.strategies.budget import ExpertBudget, budget_set, reroute
from specmoe.errors import InputError
from specmoe.models.routers import softmax_topk
from tests.decoding.test_drafters import BATCHES


def test_budget_set_keeps_top_mass_and_every_top1():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(20, 16, generator=g)
    w, ids = softmax_topk(logits, 2, True)
    allowed = budget_set(w, ids, 16, 3)
    mass = torch.zeros(16).index_add_(0, ids.reshape(-1), w.reshape(-1))
    assert allowed[torch.topk(mass, 3).indices].all() and allowed[ids[:, 0]].all()
    assert int(allowed.sum()) <= 3 + len(set(ids[:, 0].tolist()))
    w2, ids2 = reroute(logits, allowed, 2, True)
    assert allowed[ids2].all() and torch.allclose(w2.sum(-1), torch.ones(20))
    assert (ids2[:, 0] == ids[:, 0]).all(), "a token's top-1 is always allowed, so it stays first"
    full = torch.ones(16, dtype=torch.bool)
    w3, ids3 = reroute(logits, full, 2, True)
    assert torch.equal(ids3, ids) and torch.allclose(w3, w)


def _ngram(**kw):
    return LLM(dtype="float32", threads=1, decoding="specmoe", drafter="ngram", num_draft_tokens=4, **kw)


def test_budget_covering_every_expert_is_exact():
    prompts, sp = BATCHES[7]
    ref = [o.token_ids for o in LLM(dtype="float32", threads=1).generate(prompts, sp)]
    llm = _ngram(verify_expert_budget=32)
    assert [o.token_ids for o in llm.generate(prompts, sp)] == ref
    s = llm.stats
    assert s["budget_rerouted_share"] == 0.0 and s["drafted_tokens"] > 0
    assert s["budget_experts_per_layer_used"] == s["budget_experts_per_layer_exact"] > 0


def test_small_budget_reroutes_and_shrinks_the_union():
    prompts, sp = BATCHES[7]
    llm = _ngram(verify_expert_budget=2)
    outs = llm.generate(prompts, sp)
    assert [len(o.token_ids) for o in outs] == [p.max_tokens for p in sp]
    s = llm.stats
    assert s["budget_lossy"] is True and s["budget_rerouted_share"] > 0
    assert s["budget_experts_per_layer_used"] < s["budget_experts_per_layer_exact"]


def test_budget_options_are_checked():
    with pytest.raises(InputError):
        LLM(decoding="ar", verify_expert_budget=4)  # plain decoding verifies nothing
    with pytest.raises(InputError):
        _ngram(verify_expert_budget=0)
    with pytest.raises(InputError):
        _ngram(verify_expert_budget=1).generate([[1, 2, 3]], SamplingParams(max_tokens=3))  # below top-k


def test_budget_rejects_other_router_families():
    class Cfg:
        model_type, num_experts, top_k, norm_topk_prob = "deepseek_v3", 8, 2, True
    with pytest.raises(InputError):
        ExpertBudget(Cfg(), 4)


def test_padding_tokens_do_not_vote():
    class Cfg:
        model_type, num_experts, top_k, norm_topk_prob = "qwen3_moe", 8, 2, True
    logits = torch.full((3, 8), -5.0)
    logits[0, 0], logits[0, 1] = 5.0, 4.0  # real tokens: experts 0, 1
    logits[1, 0], logits[1, 1] = 5.0, 4.0
    logits[2, 6], logits[2, 7] = 9.0, 8.0  # a padding token: experts 6, 7, with the most mass
    w, ids = softmax_topk(logits, 2, True)
    hook = ExpertBudget(Cfg(), 2)
    hook.real = torch.tensor([True, True, False])
    w2, ids2 = hook(0, logits, w, ids)
    assert torch.equal(ids2, ids) and hook.rerouted == 0, "real tokens fit the budget: nothing re-routes"
    assert hook.stats()["budget_experts_per_layer_exact"] == 2
    hook.real = None  # the same forward with the padding voting: experts 6, 7 take the budget
    hook(0, logits, w, ids)
    assert hook.rerouted > 0
