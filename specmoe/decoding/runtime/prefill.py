"""Prefill: the engine core writes newly admitted prompts into the KV cache through the model runner (both in this
package, beside the `Sequence`s and sampling they use) and samples each sequence's first token; the decoding strategy
takes over from the next step."""
from __future__ import annotations

import time

from specmoe.decoding.runtime.runner import ModelRunner
from specmoe.decoding.runtime.sampling import sample
from specmoe.decoding.runtime.sequence import Sequence

MAX_PREFILL_TOKENS = 4096  # tokens per prefill forward; bounds activation memory for large batches


def prefill(runner: ModelRunner, seqs: list[Sequence], stats: dict) -> dict[int, list[int]]:
    """Write every prompt into the cache (an encoder–decoder model's sequences: their source through the encoder
    first); return {seq_id: [first sampled token]}."""
    t0 = time.perf_counter()
    for s in seqs:
        if s.source_ids is not None:
            runner.encode(s)
    out: dict[int, list[int]] = {}
    i = 0
    while i < len(seqs):
        group, n = [], 0
        while i < len(seqs) and (not group or n + len(seqs[i].prompt_ids) <= MAX_PREFILL_TOKENS):
            group.append(seqs[i])
            n += len(seqs[i].prompt_ids)
            i += 1
        logits = runner.forward(group, [s.prompt_ids for s in group])  # [B, V]
        for s in group:
            runner.commit(s, len(s.prompt_ids))
        toks = sample(logits, [s.params for s in group], [s.generator for s in group], [0] * len(group))
        out.update({s.seq_id: [t] for s, t in zip(group, toks)})
    stats["prefill_time_s"] += time.perf_counter() - t0
    stats["prompt_tokens"] += sum(len(s.prompt_ids) for s in seqs)
    return out
