"""Offloaded == resident, bit for bit, on Llama-4 (fused experts cut per expert, input-scaled routing, dense and MoE
layers) and MiniMax-M2 (sigmoid router with a correction bias): logits and greedy tokens, disk and host tiers, LRU
and on-demand policies, with a cache smaller than a batch's union of experts."""
from __future__ import annotations

import itertools

import pytest
import torch

from specmoe import LLM, SamplingParams
from tests.tiny_llama4_minimax import NEW_FAMILIES, checkpoint

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16], [20, 21], [50]]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
CASES = list(itertools.product(NEW_FAMILIES, ("disk", "host"), ("lru", "ondemand")))


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def run(llm: LLM):
    return llm.logits(PROMPTS), {b: [o.token_ids for o in llm.generate(PROMPTS[:b], GREEDY)] for b in (1, 5)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    cache = {}

    def get(family):
        if family not in cache:
            path = checkpoint(family, tmp_path_factory)
            cache[family] = (path, run(LLM(path)))
        return cache[family]
    return get


@pytest.mark.parametrize("family,tier,policy", CASES, ids=["-".join(c) for c in CASES])
def test_offloaded_equals_resident(reference, family, tier, policy):
    path, (ref_logits, ref_tokens) = reference(family)
    llm = LLM(path, offload=tier, cache_policy=policy, cache_experts=3)
    logits, tokens = run(llm)
    assert torch.equal(logits, ref_logits)
    assert tokens == ref_tokens
    s = llm.stats
    assert s["offload"] == tier and s["cache_policy"] == policy
    assert s["misses"] > 0 and s["bytes_moved"] >= s["misses"] * s["bytes_per_expert"]
    assert s["bytes_per_expert"] == llm.config.expert_numel * 4
