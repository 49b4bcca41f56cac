"""Engine-level counters; strategies and expert providers add their own sections."""
from __future__ import annotations

import itertools


def new_stats() -> dict:
    return {"requests": 0, "prompt_tokens": 0, "generated_tokens": 0, "prefill_time_s": 0.0,
            "decode_time_s": 0.0, "decode_steps": 0, "scheduling_s": 0.0, "step_breakdown": {}}


def derived(s: dict) -> dict:
    total = s["prefill_time_s"] + s["decode_time_s"]
    return {"tokens_per_s": s["generated_tokens"] / total if total else 0.0,
            "decode_tokens_per_s": s["generated_tokens"] / s["decode_time_s"] if s["decode_time_s"] else 0.0,
            "prefill_tokens_per_s": s["prompt_tokens"] / s["prefill_time_s"] if s["prefill_time_s"] else 0.0}


def memory_stats(model, expert_memory, kv_cache) -> dict:
    """Bytes per part: the non-expert weights (model parameters and buffers), each expert part of the
    ExpertMemory plan (what memory_budget / cache_bytes bound; the draft's parts are held while a
    speculative run is active), the KV cache as allocated now; their total; and the limits set."""
    weights = sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers()))
    parts = {"non_expert_weights": weights, **expert_memory.parts,
             "kv_cache": kv_cache.nbytes if kv_cache is not None else 0}
    return {**parts, "experts_total": expert_memory.total, "total": sum(parts.values()),
            "memory_budget": expert_memory.memory_budget, "cache_bytes": expert_memory.cache_bytes}
