"""Transfer accounting: bytes moved match the routing exactly; pinning, hits, prefetch counters."""
from __future__ import annotations

import time

import pytest

from specmoe import LLM, SamplingParams

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16]]


def capture(llm: LLM) -> list[tuple[int, set[int], list[int]]]:
    """Record (layer, union of routed ids, counts) of every MoE forward."""
    seen = []
    llm.store.forward_observers.append(lambda layer, routing: seen.append(
        (layer, set(routing.needed), list(routing.counts_host))))
    return seen


@pytest.mark.parametrize("offload", ["host", "disk"])
def test_ondemand_bytes_equal_union_sizes(tiny_ckpt, offload):
    llm = LLM(tiny_ckpt("qwen2_moe"), offload=offload, cache_policy="ondemand", cache_experts=2)
    seen = capture(llm)
    llm.logits(PROMPTS)
    llm.generate(PROMPTS, SamplingParams(max_tokens=4, ignore_eos=True))
    s = llm.stats
    bpe = s["bytes_per_expert"]
    cfg = llm.config
    assert bpe == 3 * cfg.hidden_size * cfg.expert_intermediate_size * 4  # fp32 tiny checkpoint
    want = sum(len(u) for _, u, _ in seen)
    assert s["hits"] == 0 and s["misses"] == want and s["fetches"] == want
    assert s["bytes_moved"] == want * bpe
    assert s["bytes_per_token"] == want * bpe / s["generated_tokens"]
    for i, layer in enumerate(cfg.moe_layers):  # per layer too
        assert s["misses_per_layer"][i] == sum(len(u) for lay, u, _ in seen if lay == layer)
        assert s["expert_counts"][i] == [sum(c[e] for lay, _, c in seen if lay == layer)
                                         for e in range(cfg.num_experts)]
    assert s["scratch_fetches"] > 0  # 3-prompt prefill unions exceed 2 slots: spare buffers, no failure


def test_lru_hits_plus_misses_and_reset(tiny_ckpt):
    llm = LLM(tiny_ckpt("mixtral"), offload="host", cache_policy="lru", cache_experts=8)
    seen = capture(llm)
    llm.logits(PROMPTS)
    first = llm.stats
    assert first["misses"] == sum(len(u) for _, u, _ in seen)  # cold cache: every expert once
    seen.clear()
    llm.logits(PROMPTS)  # everything fits: all hits now
    s = llm.stats
    assert s["misses"] == first["misses"] and s["hits"] == sum(len(u) for _, u, _ in seen)
    assert s["bytes_moved"] == s["misses"] * s["bytes_per_expert"]
    llm.reset_stats()
    s = llm.stats
    assert s["bytes_moved"] == s["hits"] == s["misses"] == 0


def test_pin_and_resident(tiny_ckpt):
    llm = LLM(tiny_ckpt("olmoe"), offload="disk", cache_policy="ondemand", cache_experts=4)
    p = llm.store
    layer = llm.config.moe_layers[0]
    p.pin(layer, [1, 5])
    assert p.resident(layer) == {1, 5}
    s = llm.stats
    assert s["pin_bytes"] == 2 * s["bytes_per_expert"] == s["bytes_moved"]
    seen = capture(llm)
    llm.logits(PROMPTS)
    assert {1, 5} <= p.resident(layer)  # never evicted, even by ondemand
    assert p.resident(layer) == {1, 5}  # ondemand keeps nothing else
    s = llm.stats
    u0 = [u for lay, u, _ in seen if lay == layer][0]
    assert s["hits_per_layer"][0] == len(u0 & {1, 5})
    assert s["bytes_moved"] == (2 + sum(len(u) for _, u, _ in seen) - len(u0 & {1, 5})) * s["bytes_per_expert"]
    p.pin(layer, [5, 6])  # replaces the set: only expert 6 moves
    assert s["pin_bytes"] + s["bytes_per_expert"] == llm.stats["pin_bytes"]
    assert p.resident(layer) == {5, 6}
    with pytest.raises(Exception, match="cannot pin"):
        p.pin(layer, list(range(5)))


def test_prefetch_counters(tiny_ckpt):
    llm = LLM(tiny_ckpt("qwen3_moe"), offload="host", cache_policy="ondemand", cache_experts=4, prefetch="predicted")
    llm.generate(PROMPTS, SamplingParams(max_tokens=4, ignore_eos=True))
    s = llm.stats
    assert s["prefetch_bytes"] > 0
    assert s["prefetch_bytes"] == (s["prefetch_useful"] + s["prefetch_wasted"]) * s["bytes_per_expert"]
    assert s["bytes_moved"] == s["prefetch_bytes"] + s["misses"] * s["bytes_per_expert"]


def test_emulated_link_is_throttled_and_labelled(tiny_ckpt):
    llm = LLM(tiny_ckpt("mixtral"), offload="host", cache_policy="ondemand", cache_experts=2,
              link_gbps=0.001, link_latency_us=1000.0)  # 1 MB/s + 1 ms: ~10 ms per 9 KiB expert
    t0 = time.perf_counter()
    llm.logits(PROMPTS[:1])
    dt = time.perf_counter() - t0
    s = llm.stats
    per = 1e-3 + s["bytes_per_expert"] / 1e6
    assert dt >= s["fetches"] * per * 0.99
    assert s["emulated_link"] is True and s["link_gbps"] == 0.001 and s["link_latency_us"] == 1000.0
    assert s["fetch_wait_s"] > 0


def test_resident_reports_counts(tiny_ckpt):
    llm = LLM(tiny_ckpt("mixtral"))
    llm.logits([[1, 2, 3, 4], [5, 6, 7, 8]])  # equal lengths: padded positions would be routed (and counted) too
    s = llm.stats
    assert s["offload"] == "none" and s["bytes_moved"] == 0
    assert sum(map(sum, s["expert_counts"])) == len(llm.config.moe_layers) * 8 * llm.config.top_k


def test_static_policy_reads_shipped_profile(tmp_path):
    from tests.conftest import make_tiny_checkpoint
    path = make_tiny_checkpoint("mixtral", tmp_path / "ck")
    counts = [[1] * 8 for _ in range(3)]
    for layer, hot in enumerate((7, 0, 3)):
        counts[layer][hot] = 100
    (path / "expert_profile.json").write_text(__import__("json").dumps({"counts": counts}))
    llm = LLM(path, offload="host", cache_policy="static", cache_experts=4)
    assert llm.store.static_experts == {0: [7], 1: [0], 2: [3]}  # ceil(10% of 8) = 1 per layer
    assert llm.stats["static_bytes"] == 3 * llm.stats["bytes_per_expert"]
    llm.logits(PROMPTS)
    assert all({e} <= llm.store.resident(layer) for layer, e in ((0, 7), (1, 0), (2, 3)))
    llm.store.evict_all()  # static experts survive a cold-cache reset
    assert llm.store.resident(0) == {7}


def test_oracle_recording_restarts_the_trace(tiny_ckpt):
    llm = LLM(tiny_ckpt("mixtral"), offload="host", cache_policy="ondemand", cache_experts=8, prefetch="oracle")
    llm.logits([[9, 9, 9]])  # a warm-up that must not be part of the trace
    llm.store.start_oracle_recording()
    llm.logits(PROMPTS)
    llm.store.start_oracle_replay()
    llm.store.evict_all()
    llm.reset_stats()
    llm.logits(PROMPTS)
    s = llm.stats
    assert s["oracle_mismatches"] == 0 and s["prefetch_wasted"] == 0 and s["prefetch_useful"] > 0
    # 8 slots hold any union: every layer after the first is prefetched exactly, only layer 0 misses
    assert s["misses_per_layer"][1:] == [0, 0] and s["hits_per_layer"][0] == 0


def test_pin_swaps_a_full_pinned_set(tiny_ckpt):
    """Replacing a pinned set that fills every slot with a disjoint one must evict the old set."""
    from specmoe import LLM
    llm = LLM(tiny_ckpt("qwen3_moe"), dtype="float32", offload="host", cache_experts=4, cache_policy="lru")
    cache = llm.store
    layer = llm.config.moe_layers[0]
    cache.pin(layer, [0, 1, 2, 3])
    assert cache.resident(layer) == {0, 1, 2, 3}
    cache.pin(layer, [4, 5, 6, 7])
    assert cache.resident(layer) == {4, 5, 6, 7}
