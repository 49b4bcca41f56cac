"""Plain autoregressive decoding: one token per sequence per step (the prompts were prefilled by the engine core,
`runtime.prefill`)."""
from __future__ import annotations

from specmoe.decoding.runtime.breakdown import StepBreakdown
from specmoe.decoding.runtime.runner import ModelRunner
from specmoe.decoding.runtime.sampling import sample
from specmoe.decoding.runtime.sequence import Sequence
from specmoe.decoding.strategies.clock import PhaseClock
from specmoe.decoding.strategies.protocol import StepInput, StepOutput, StrategyStats


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
