"""What a speculative step does (`StepPlan`, the decoder's), what `auto`'s controller decided for it
(`Plan`, from `Controller.choose`, as the decoder and the feedback read it) and how it priced the arms."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specmoe.decoding.control.candidates import Candidate


@dataclass
class StepPlan:
    """What a step does: drafter_of[b] (None: row b drafts nothing) and gammas[b] (its most draft tokens).
    `decision`: the controller's record of the choice (None for a fixed configuration, or a reused plain call)."""
    drafter_of: list[str | None]
    gammas: list[int]
    decision: Plan | None = None
    width: int | None = None  # branches per tree node (1: chains; None: the decoder's configured width)

    @property
    def plain(self) -> bool:
        return not any(g and d for d, g in zip(self.drafter_of, self.gammas))


@dataclass
class Plan:
    kind: str                    # "plain" | "spec"
    gammas: list[int] | None     # per sequence (spec)
    theta: float                 # in-draft stopping threshold on the running acceptance probability
    predicted_s: float           # refined prediction of the chosen step
    raw_s: float                 # before the time refinement
    predicted_misses: float
    plain_rate: float            # predicted tokens/s of the plain step and of the best speculative plan
    spec_rate: float
    reason: str = "model"        # "model" | "forced" | "schedule" | "explore" | "coast"
    spec_gammas: list[int] | None = None  # the best speculative plan's γ_b, chosen or not
    drafter_of: list[str | None] | None = None  # per sequence (spec)
    spec_drafters: list[str | None] | None = None  # the best speculative plan's drafters, chosen or not
    arm: str = "plain"           # "plain" or the chosen speculative plan's drafter (mix), e.g. "eagle+ngram"
    raw_rate: float = 0.0        # the chosen arm's predicted tokens/s before its realized correction
    probs: np.ndarray | None = None  # [B, γ_max] each drafting row's acceptance probabilities before calibration
    width: int = 1               # branches per tree node: 1 for a chain arm, the decoder's width for a tree arm


@dataclass
class PricedPlain:
    """A plain step at this batch, priced: raw and refined seconds, its rate (corrected by what plain steps
    realized, plus the step's cost outside the model) and its rate before that correction."""
    raw_s: float
    step_s: float
    rate: float
    raw_rate: float


@dataclass
class PricedArm:
    """An arm's best candidate, priced: tokens/s on unbiased estimates (`rate`) and on upper-confidence ones
    (`optimistic`, for pruning), raw draft and verify seconds, refined step seconds, expected misses, and its rate
    before the realized correction."""
    cand: Candidate
    rate: float
    optimistic: float
    draft_s: float
    verify_s: float
    step_s: float
    misses: float
    raw_rate: float

    @property
    def tag(self) -> str:
        return self.cand.tag
