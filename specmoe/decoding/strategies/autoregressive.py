"""Plain autoregressive decoding: prefill, then one token per sequence per step."""
from __future__ import annotations

import time

from specmoe.decoding.runtime.breakdown import StepBreakdown
from specmoe.decoding.runtime.runner import ModelRunner
from specmoe.decoding.runtime.sampling import sample
from specmoe.decoding.runtime.sequence import Sequence
from specmoe.decoding.strategies.clock import PhaseClock
from specmoe.decoding.strategies.protocol import StepInput, StepOutput, StrategyStats

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


def plain_tokens(runner: ModelRunner, seqs: list[Sequence], clock: PhaseClock, ctx=None) -> list[int]:
    """The plain step: one target forward over each sequence's pending token ("verify": its K/V committed), and
    the token sampled from it ("accept"). `ctx`: the forward's context (default: the runner's)."""
    with clock.phase("verify"):
        logits = runner.forward(seqs, [[s.output_ids[-1]] for s in seqs], ctx=ctx)  # [B, V]
        for s in seqs:
            runner.commit(s, 1)
    with clock.phase("accept"):
        return sample(logits, [s.params for s in seqs], [s.generator for s in seqs],
                      [len(s.output_ids) for s in seqs])


class AutoregressiveDecoder:
    """One target forward per step over the last token of every active sequence."""
    name = "ar"

    def __init__(self, runner: ModelRunner):
        self.runner = runner
        self.breakdown = StepBreakdown()

    def stats(self) -> StrategyStats:
        return StrategyStats(self.name, dict(self.breakdown.s))

    def step(self, inp: StepInput) -> StepOutput:
        clock = PhaseClock(self.runner, sync=False)
        toks = plain_tokens(self.runner, inp.seqs, clock)
        self.breakdown.target(*clock.spans["verify"])
        self.breakdown.accept(clock.wall("accept"))
        return StepOutput({s.seq_id: [t] for s, t in zip(inp.seqs, toks)})
