"""The s3fifo cache policy (experts/policies.py): its decisions on hand-built request streams, and an offloaded
model under it giving the resident model's tokens while it really evicts."""
from __future__ import annotations

import pytest
import torch

from specmoe import LLM, SamplingParams
from specmoe.experts.policies import LayerSlots, make_policy

E = 64


def stream(policy: str, requests: list[list[int]], slots: int, *, pinned: set[int] = frozenset()):
    """Run `requests` through one layer's slots in the cache's order (hits counted; each miss takes a free slot or
    the policy's victim, never one of the forward's own experts; then `touch`). Returns (hits per request, L)."""
    p = make_policy(policy)
    L = LayerSlots(torch.zeros(slots, 8, dtype=torch.uint8), E, ())
    for e in pinned:
        L.slot_of[e] = L.free.pop()
        L.recency[e] = None
    L.pinned = set(pinned)
    hits = []
    for ids in requests:
        hits.append(sum(e in L.slot_of for e in ids))
        for e in ids:
            if e in L.slot_of:
                continue
            if L.free:
                s = L.free.pop()
            else:
                v = p.victim(L, set(ids))
                assert v is not None and v not in ids and v not in L.pinned
                L.recency.pop(v)
                s = L.slot_of.pop(v)
            L.slot_of[e] = s
            L.recency[e] = None
        p.touch(L, ids)
    return hits, L


HOT = [0, 1, 2, 3, 4]
WARM = [[e] for _ in range(4) for e in HOT]  # the hot experts, each requested 4 times
SCAN = [[e] for e in range(20, 50)]  # 30 experts requested once each
AFTER = [[e] for e in HOT]


@pytest.mark.parametrize("slots", [8, 10, 16])
def test_a_scan_does_not_evict_the_reused_experts_under_s3fifo_but_does_under_lru(slots):
    n = len(WARM) + len(SCAN)
    s3, L = stream("s3fifo", WARM + SCAN + AFTER, slots)
    lru, _ = stream("lru", WARM + SCAN + AFTER, slots)
    assert sum(s3[n:]) == len(HOT)  # every hot expert survived the scan
    assert sum(lru[n:]) == 0  # LRU: the scan pushed every one out
    assert set(HOT) <= set(L.fifo.main)
    st = make_policy("s3fifo").stats([L])
    assert st["s3fifo_small_evictions"] >= len(SCAN) - slots and st["s3fifo_promotions"] >= len(HOT)


def test_an_id_in_the_ghost_goes_straight_to_main_and_then_survives_a_scan():
    slots = 10  # small holds 1 (10%), main 9, ghost 9
    first = [[7]] + [[e] for e in range(20, 23)]  # 7 once, then pushed out of small unrequested by three others
    hits, L = stream("s3fifo", first, slots)
    # nothing evicted yet (10 free slots): fill the cache so that 7 leaves small
    hits, L = stream("s3fifo", first + [[e] for e in range(23, 30)] + [[30]], slots)
    assert 7 not in L.slot_of and 7 in L.fifo.ghost  # evicted from small unrequested: remembered
    hits, L = stream("s3fifo", first + [[e] for e in range(23, 30)] + [[30], [7]], slots)
    assert 7 in L.fifo.main and 7 not in L.fifo.ghost and L.fifo.n["ghost_hits"] == 1
    scan = [[e] for e in range(40, 60)]
    hits, L = stream("s3fifo", first + [[e] for e in range(23, 30)] + [[30], [7]] + scan + [[7]], slots)
    assert hits[-1] == 1  # came back through the ghost: main kept it through a scan it never saw again in


def test_lru_loses_the_ghost_promoted_expert_to_the_same_scan():
    reqs = [[7]] + [[e] for e in range(20, 30)] + [[30], [7]] + [[e] for e in range(40, 60)] + [[7]]
    assert stream("lru", reqs, 10)[0][-1] == 0


def test_pinned_and_kept_experts_are_never_evicted_and_capacity_excludes_pinned():
    reqs = [[e, e + 1] for e in range(10, 60, 2)]  # pairs: each forward's own experts are `keep`
    hits, L = stream("s3fifo", reqs, 6, pinned={1, 2})
    assert {1, 2} <= set(L.slot_of) and not ({1, 2} & set(L.fifo.count))  # pinned: outside the queues
    assert make_policy("s3fifo").capacity(L) == 4
    assert set(L.fifo.small) | set(L.fifo.main) == set(L.slot_of) - {1, 2}  # the queues track every other slot


def test_experts_that_left_outside_the_policy_are_forgotten():
    hits, L = stream("s3fifo", [[e] for e in range(12)], 8)
    p = make_policy("s3fifo")
    gone, held = list(L.fifo.small)[:2]  # the two oldest: the next victims
    L.free.append(L.slot_of.pop(gone))  # e.g. a failed load released its slot
    L.recency.pop(gone)
    L.static = {held}
    v = p.victim(L, set())
    assert v != gone and v not in L.static and gone not in L.fifo.count and not (L.static & set(L.fifo.count))


def test_a_prefetched_expert_is_queued_as_new():
    hits, L = stream("s3fifo", [[e] for e in range(8)], 8)
    p = make_policy("s3fifo")
    v = p.victim(L, set())  # make room for a prefetch of expert 40
    L.recency.pop(v)
    L.slot_of[40] = L.slot_of.pop(v)
    L.recency[40] = None
    L.prefetched.add(40)
    assert p.victim(L, set()) != 40  # the next miss's victim: 40 joins small as the newest, unrequested
    assert list(L.fifo.small)[-1] == 40 and L.fifo.count[40] == 0


PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16]]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.mark.parametrize("tier", ["disk", "host"])
def test_offloaded_under_s3fifo_equals_resident_and_evicts(tiny_ckpt, tier):
    path = tiny_ckpt("qwen3_moe")
    ref = LLM(path)
    want_logits, want = ref.logits(PROMPTS), [o.token_ids for o in ref.generate(PROMPTS, GREEDY)]
    llm = LLM(path, offload=tier, cache_policy="s3fifo", cache_experts=3)
    assert torch.equal(llm.logits(PROMPTS), want_logits)
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    assert [[o.token_ids] for o in llm.generate(PROMPTS[:1], GREEDY)] == [[want[0]]]
    s = llm.stats
    assert s["cache_policy"] == "s3fifo" and s["offload"] == tier
    assert s["misses"] > 0 and s["s3fifo_small_evictions"] + s["s3fifo_main_evictions"] > 0


def routing_of(llm: LLM, tokens: list[int]) -> list[list[list[int]]]:
    """Each MoE layer's top-k ids per token of one teacher-forced forward over `tokens` (batch 1)."""
    from specmoe.decoding.runtime.sequence import Sequence
    got = {}

    def observe(layer, routing):
        got[layer] = [sorted(set(r)) for r in routing.ids.tolist()]

    runner = llm.runner(1, len(tokens))
    seq = Sequence(seq_id=0, prompt_ids=tokens, params=SamplingParams(), slot=0, generator=torch.Generator())
    runner.forward([seq], [tokens], ctx=runner.context(observers=[observe]))
    return [got[layer] for layer in llm.config.moe_layers]


@pytest.mark.parametrize("policy", ["lru", "adaptive", "s3fifo"])
def test_a_replayed_routing_stream_gives_the_engines_hits(tiny_ckpt, policy):
    """replay() (the benchmark's hit rates) walks a stream as ExpertCache.fetch does: on the routing of a forced
    batch-1 decode it counts the engine's hits and misses exactly."""
    from specmoe.experts.replay import replay
    path = tiny_ckpt("qwen3_moe")
    ref = LLM(path)
    doc = [(7 * i * i + 3 * i) % (ref.config.vocab_size - 1) + 1 for i in range(60)]
    stream = routing_of(ref, doc[:-1])  # the engine runs doc[0] (the prompt), then each forced token but the last
    llm = LLM(path, offload="host", cache_policy=policy, cache_experts=3)
    out = llm.generate([doc[:1]], SamplingParams(max_tokens=len(doc) - 1, temperature=0.0, ignore_eos=True,
                                                 forced_tokens=doc[1:]))
    assert out[0].token_ids == doc[1:]
    got = replay(policy, stream, 3, llm.config.num_experts)
    s = llm.stats
    assert (got.hits, got.misses) == (s["hits"], s["misses"]) and got.misses > 0 and got.hits > 0


def test_the_default_policy_is_s3fifo_on_the_disk_tier_and_adaptive_elsewhere(tiny_ckpt):
    from specmoe.options import OffloadConfig
    assert OffloadConfig(offload="disk").cache_policy == "s3fifo"
    assert OffloadConfig(offload="host").cache_policy == "adaptive"
    assert OffloadConfig(offload="disk", cache_policy="lru").cache_policy == "lru"
    assert LLM(tiny_ckpt("qwen3_moe"), offload="disk", cache_experts=3).stats["cache_policy"] == "s3fifo"
