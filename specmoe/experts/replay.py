"""Replay a recorded routing stream through a cache policy's bookkeeping, without weights or transfers.

A stream is, per MoE layer, the list of expert-id unions one forward after another asked that layer for
(benchmarks/cache_policy_bench.py records it from a teacher-forced forward: each token of a document is one batch-1
decode step).
`replay` walks it in `ExpertCache.fetch`'s order: hits counted on what is resident, each miss takes a free slot
or the policy's victim (never one of the forward's own experts), the policy's `touch`, then what it drops after
the forward. Same policy objects, so a hit rate here is the engine's on the same stream (a test checks it against
`llm.stats`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specmoe.experts.policies import LayerSlots, make_policy


@dataclass
class ReplayResult:
    policy: str
    slots: int
    hits: int
    misses: int
    scratch: int  # misses that found no slot (a union larger than the slots: streamed, not kept)

    @property
    def hit_rate(self) -> float:
        n = self.hits + self.misses
        return self.hits / n if n else 0.0


def replay(policy: str, stream: list[list[list[int]]], slots: int, num_experts: int,
           counted: list[bool] | None = None) -> ReplayResult:
    """`stream[layer][step]`: the sorted expert ids that forward needed in that layer; every layer has `slots`
    slots under its own copy of the policy's state (as the cache keeps one LayerSlots per layer). `counted[step]`
    (default: every step) says which steps' hits and misses are counted (e.g. decode steps, not a prompt's
    prefill); the others still go through the bookkeeping."""
    p = make_policy(policy)
    hits = misses = scratch = 0
    for steps in stream:
        L = LayerSlots(torch.empty(slots, 0, dtype=torch.uint8), num_experts, ())
        for i, ids in enumerate(steps):
            need, n = set(ids), counted is None or counted[i]
            for e in ids:
                if e in L.slot_of:
                    hits += n
                    continue
                misses += n
                if L.free:
                    s = L.free.pop()
                else:
                    v = p.victim(L, need)
                    if v is None:
                        scratch += n
                        continue
                    L.recency.pop(v)
                    s = L.slot_of.pop(v)
                L.slot_of[e] = s
                L.recency[e] = None
            p.touch(L, ids)
            for e in p.after_forward(L):
                L.free.append(L.slot_of.pop(e))
                L.recency.pop(e, None)
    return ReplayResult(policy, slots, hits, misses, scratch)

