"""The typed boundary between the engine and a decoding strategy: one `step(StepInput) -> StepOutput` per decode
step over the active sequences, and `stats() -> StrategyStats`. The engine says which sequences are new since the
last step and which left (a strategy keeps per-sequence state: a drafter's catch-up, the controller's per-sequence
acceptance; ids are reused once a sequence finishes), so no strategy infers them from object identity."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from specmoe.decoding.runtime.sequence import Sequence


@dataclass(frozen=True)
class StepInput:
    """One decode step: `seqs`, the active sequences in batch order; `new`, those among them admitted since the
    last step (their first decode step); `finished`, the ids of the sequences that left since the last step."""
    seqs: list[Sequence]
    new: list[Sequence] = field(default_factory=list)
    finished: list[int] = field(default_factory=list)

    @classmethod
    def first(cls, seqs: list[Sequence]) -> "StepInput":
        """Every sequence new (a strategy's first step over them)."""
        return cls(list(seqs), list(seqs), [])


@dataclass(frozen=True)
class StepOutput:
    """The tokens each sequence emitted this step (seq_id -> tokens, one or more)."""
    tokens: dict[int, list[int]]


@dataclass
class StrategyStats:
    """A strategy's counters: its name, its phases' seconds (`step_breakdown`, summed into the engine's) and its
    own section (flat, JSON-ready: what `llm.stats` shows beside the engine's counters)."""
    decoding: str
    step_breakdown: dict[str, float] = field(default_factory=dict)
    counters: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"decoding": self.decoding, **self.counters, "step_breakdown": dict(self.step_breakdown)}


class DecodingStrategy(Protocol):
    name: str

    def step(self, inp: StepInput) -> StepOutput: ...

    def stats(self) -> StrategyStats: ...
