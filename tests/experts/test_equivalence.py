"""Offloaded == resident, bit for bit: logits and greedy tokens, every policy × tier × batch size × family."""
from __future__ import annotations

import itertools

import pytest
import torch

from specmoe import LLM, SamplingParams
from tests.conftest import FAMILIES

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [20, 21], [30, 31, 32, 33],
           [40, 41, 42, 43, 44, 45], [50], [60, 61, 62, 63, 64, 65, 66, 67, 68]]
POLICIES = ("ondemand", "static", "lru", "lfu", "s3fifo")
TIERS = {"host": dict(offload="host"), "disk": dict(offload="disk"),
         "link": dict(offload="host", link_gbps=2.0, link_latency_us=20.0)}
BATCHES = (1, 3, 8)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def run(llm: LLM):
    """(logits of the 8 prompts, greedy token ids at batch 1, 3 and 8)."""
    return llm.logits(PROMPTS), {b: [o.token_ids for o in llm.generate(PROMPTS[:b], GREEDY)] for b in BATCHES}


@pytest.fixture(scope="module")
def reference(tiny_ckpt):
    cache = {}

    def get(family):
        if family not in cache:
            cache[family] = run(LLM(tiny_ckpt(family)))
        return cache[family]
    return get


# Every (policy, tier) pair on every family; cache sizes cycle so each family also sees a cache
# smaller than a batch's union (evictions and scratch buffers) and one holding half the experts.
CASES = [(f, p, t, 2 + (i % 3)) for i, (f, p, t) in enumerate(itertools.product(FAMILIES, POLICIES, TIERS))]


@pytest.mark.filterwarnings("ignore:.*no expert_profile.json")
@pytest.mark.parametrize("family,policy,tier,slots", CASES, ids=[f"{f}-{p}-{t}-s{s}" for f, p, t, s in CASES])
def test_offloaded_equals_resident(tiny_ckpt, reference, family, policy, tier, slots):
    ref_logits, ref_tokens = reference(family)
    llm = LLM(tiny_ckpt(family), cache_policy=policy, cache_experts=slots, **TIERS[tier])
    logits, tokens = run(llm)
    assert torch.equal(logits, ref_logits)
    assert tokens == ref_tokens
    s = llm.stats
    assert s["offload"] == TIERS[tier]["offload"] and s["cache_policy"] == policy
    assert s["emulated_link"] == (tier == "link")
    assert s["hits"] + s["misses"] > 0 and s["bytes_moved"] >= s["misses"] * s["bytes_per_expert"]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("prefetch,policy", [("predicted", "ondemand"), ("predicted", "lru"), ("oracle", "lfu"),
                                            ("predicted", "s3fifo")])
def test_prefetch_equals_resident(tiny_ckpt, reference, family, prefetch, policy):
    ref_logits, ref_tokens = reference(family)
    llm = LLM(tiny_ckpt(family), offload="disk", cache_policy=policy, cache_experts=3, prefetch=prefetch)
    if prefetch == "oracle":  # record once, then replay with the true next-layer union prefetched
        # The replay must see the very same forwards as the recording. LLM.logits after a generate that
        # grew the KV cache differs in the last bits (a larger cache changes the attention kernel's
        # reduction), so record from the same fresh-engine state the reference ran in.
        ref_llm = LLM(tiny_ckpt(family))
        assert torch.equal(run(ref_llm)[0], ref_logits)
        run(llm)  # record
        llm._cache = None  # back to the fresh-engine KV cache state the recording started from
        llm.store.start_oracle_replay()
        llm.store.evict_all()
        llm.reset_stats()
    logits, tokens = run(llm)
    assert torch.equal(logits, ref_logits)
    assert tokens == ref_tokens
    s = llm.stats
    assert s["prefetch_bytes"] > 0 and s["prefetch_useful"] > 0
    if prefetch == "oracle":
        assert s["oracle"] == "replaying" and s["oracle_mismatches"] == 0


@pytest.mark.cuda
@pytest.mark.parametrize("offload", ["host", "disk"])
def test_cuda_offloaded_equals_resident(tiny_ckpt, offload):
    path = tiny_ckpt("mixtral")
    ref = LLM(path, device="cuda")
    llm = LLM(path, device="cuda", offload=offload, cache_policy="lru", cache_experts=2, prefetch="predicted")
    assert torch.equal(llm.logits(PROMPTS), ref.logits(PROMPTS))
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == [o.token_ids for o in ref.generate(PROMPTS, GREEDY)]
