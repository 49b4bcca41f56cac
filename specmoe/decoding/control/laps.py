"""Laps: what a batch's ragged tail costs each arm, measured over whole batches.

A closed batch (rows that start together and stop at their token budgets) ends in a ragged tail: its rows finish
steps apart, and the last steps run few rows at a worse rate than its full ones. Deeper drafts finish the rows
further apart, so per-step rates at the batch's own bucket do not see what the tail costs each arm: at batch 4
eagle-g4's full steps measured as fast as eagle-g2's (423 vs 420 tok/s), while over whole batches the fixed g4
ran 335 tok/s and the fixed g2 375.

A *lap* runs from a step whose batch grew (rows admitted) to the step before the next one that grows it. Its *peak*
steps are those with as many rows as its first (the full batch); the lap is filed under that step's bucket. A lap
whose peak steps were (mostly, `PURE`) one arm's is that arm's: its *factor* is the lap's tokens per second over
its peak steps' tokens per second (realized tokens: the ratio is the tail's, whatever the crediting), a ratio of
sums over its last `KEEP` laps, shrunk toward the bucket's (`of`). A batch that never shrinks (one row at a time,
or a server whose batch keeps being refilled) closes no lap with a tail, and its factor stays near 1.

A lap also keeps what its peak steps were credited with (`rates.ArmRates.record`'s pooled-acceptance tokens): an arm
with laps of its own at a bucket is priced there by what they realized per credited token (`priced`: whole laps'
realized tokens/s over their peak steps' credited tokens/s), which takes in the tail and whatever the arm's credit
reads off at that batch size. The arm's calibration over all its steps (`rates.ArmRates.kappa`) pools batch sizes: at
batch 64 eagle-g4's credited full steps read 3% faster than eagle-g2's and its lap factor 2% worse, a tie, while
the fixed eagle-g2 ran 8% faster than the fixed eagle-g4 over whole batches, and `auto` ran eagle-g4.

An arm with no laps of its own at a bucket is priced by what the laps there say of its *spread* (`spread`: the standard
deviation of a row's tokens per step over the square root of their mean, from its drafter's acceptance per draft
position; a row needing N tokens finishes after N/μ steps give or take √N·σ/μ^1.5, so the rows' finishing steps spread
apart, relative to a batch's length, in proportion to σ/√μ): a bucket's tail loss (1 − factor) is fitted as w + c·spread
over the arms with laps there (`_fit`: w, the workload's own spread, from a plain arm's laps; with laps of one spread
only, w = 0), and the arm's prior is 1 − (w + c·its spread) (`prior`). Priced with the bucket's pooled factor, a shorter
draft inherited a deeper one's tail: at batch 64 on the demo model (fp32, fixed engines, 32 tokens per row;
benchmarks/lap_tails.py) eagle-g1/g2/g3/g4 lost 7.3/10.3/14.8/16.3% of their full steps' rate to the tail, plain none,
at realized spreads 0.29/0.51/0.70/0.90; priced with eagle-g4's factor, eagle-g2 read 7% below its own, and in a trace
of 14 batches `auto` ran eagle-g4 on eleven in a row while the fixed eagle-g2 ran faster (priced by its spread: on
four). The loss grows less than in proportion to the spread (1.42/2.04/2.24x g1's against 1.77/2.44/3.13x), so from a
deeper draft's laps a shorter one is priced a little high (eagle-g2 from eagle-g4's: a loss of 9.2% against its 10.3%),
the side a measurement corrects once it runs batches of its own. An arm whose spread is not known (a mix, a tree, per-
row lengths) is priced with the pooled factor.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from specmoe.decoding.control.refinement import bucket


def spread(position, g: int) -> float:
    """σ/√μ of a row's tokens per step (μ its mean, σ its standard deviation) drafting a chain of `g` tokens whose
    j-th draft is accepted with probability position[j] (all before it accepted: non-increasing), and emitting one
    token more than it accepted; 0 for plain (g = 0: one token a step)."""
    p = np.minimum.accumulate(np.clip(np.asarray(position, dtype=float)[:g], 0.0, 1.0))
    if p.size == 0:
        return 0.0
    # E[accepted] = Σ P(accepted ≥ k), E[accepted²] = Σ (2k − 1) P(accepted ≥ k)
    mean = float(p.sum())
    var = max(0.0, float(((2 * np.arange(1, p.size + 1) - 1) * p).sum()) - mean * mean)
    return math.sqrt(var / (1.0 + mean))


@dataclass
class _Lap:
    rows: int                                 # the first step's rows (a peak step has as many)
    tokens: float = 0.0
    seconds: float = 0.0
    peak_tokens: float = 0.0
    peak_seconds: float = 0.0
    peak_credit: float = 0.0                  # what the peak steps were credited with (pooled-acceptance tokens)
    arms: dict = field(default_factory=dict)  # arm -> its steps at the peak
    clean: bool = True                        # no step of no arm (forced, scheduled) in it


@dataclass
class Laps:
    """Per (arm, peak bucket): its last `KEEP` laps as (tokens, seconds, peak tokens, peak seconds, peak credit)."""
    KEEP: int = 8
    PURE: float = 0.75   # share of a lap's peak steps its arm must have run for the lap to be its
    PRIOR: float = 4.0   # pseudo-laps at the bucket's factor in an arm's (`of`)
    LOW: float = 0.2     # a prior factor (`prior`) stays at or above this
    done: dict = field(default_factory=dict)
    spreads: dict = field(default_factory=dict)  # arm -> its spread (`spread`), as its drafter's acceptance says now
    cur: _Lap | None = None
    last_B: int = 0

    def step(self, arm: str, B: int, tokens: float, seconds: float, credit: float | None = None) -> None:
        """One step of `arm` at batch B: emitted `tokens` (realized) in `seconds`, credited with `credit` (None: its
        tokens)."""
        if self.cur is None or B > self.last_B:
            self._close()
            self.cur = _Lap(B)
        self.last_B = B
        lap = self.cur
        lap.tokens += tokens
        lap.seconds += seconds
        if B >= lap.rows:
            lap.peak_tokens += tokens
            lap.peak_seconds += seconds
            lap.peak_credit += tokens if credit is None else credit
            lap.arms[arm] = lap.arms.get(arm, 0) + 1

    def interrupt(self) -> None:
        """A step of no arm: the lap it falls in is no arm's."""
        if self.cur is not None:
            self.cur.clean = False

    def _close(self) -> None:
        lap, self.cur = self.cur, None
        if lap is None or not lap.clean or lap.peak_seconds <= 0 or lap.peak_tokens <= 0 or lap.peak_credit <= 0:
            return
        arm, n = max(lap.arms.items(), key=lambda kv: kv[1])
        if n < self.PURE * sum(lap.arms.values()):
            return
        d = self.done.setdefault((arm, bucket(lap.rows)), deque(maxlen=self.KEEP))
        d.append((lap.tokens, lap.seconds, lap.peak_tokens, lap.peak_seconds, lap.peak_credit))

    def factor(self, arm: str, b: int) -> float | None:
        """Whole laps' tokens/s over their peak steps' tokens/s, for `arm`'s laps peaking at bucket b (None: none
        closed yet)."""
        d = self.done.get((arm, b))
        if not d:
            return None
        t, s, pt, ps = (sum(x[i] for x in d) for i in range(4))
        return (t / s) / (pt / ps)

    def pooled(self, b: int) -> float | None:
        """The bucket's factor: every arm's at b, weighted by its laps (None: no lap peaked at b)."""
        n = {a: len(d) for (a, k), d in self.done.items() if k == b and d}
        return sum(c * self.factor(a, b) for a, c in n.items()) / sum(n.values()) if n else None

    def _fit(self, b: int) -> tuple[float, float] | None:
        """(w, c) of a tail loss w + c·spread fitted over the arms with laps at b and a known spread, each weighted
        by its laps (least squares, c ≥ 0 and w ≥ 0); with laps of one spread only, w = 0 (the spread carries the
        tail: a closed batch of equal budgets); None while no arm with laps there has a known spread above 0."""
        pts = [(self.spreads[a], 1.0 - self.factor(a, k), len(d)) for (a, k), d in self.done.items()
               if k == b and d and self.spreads.get(a) is not None]
        if not pts:
            return None
        n = sum(x[2] for x in pts)
        ms, ml = (sum(x[i] * x[2] for x in pts) / n for i in (0, 1))
        sxx = sum(x[2] * (x[0] - ms) ** 2 for x in pts)
        if sxx > 1e-9:
            c = max(0.0, sum(x[2] * (x[0] - ms) * (x[1] - ml) for x in pts) / sxx)
            w = ml - c * ms
            if w < 0.0:  # a negative workload tail: through the origin instead
                w, c = 0.0, max(0.0, sum(x[2] * x[0] * x[1] for x in pts) / sum(x[2] * x[0] ** 2 for x in pts))
            return w, c
        return (0.0, ml / ms) if ms > 0 else None

    def prior(self, arm: str, b: int) -> float:
        """What `arm`'s laps at b are expected to realize before it has enough of them: 1 − (w + c·its spread)
        (`_fit`, module docstring); the bucket's pooled factor where its spread or the fit is not known; 1 where no
        lap peaked at b."""
        pool = self.pooled(b)
        if pool is None:
            return 1.0
        s, fit = self.spreads.get(arm), self._fit(b)
        if s is None or fit is None:
            return pool
        return min(1.0, max(self.LOW, 1.0 - fit[0] - fit[1] * s))

    def of(self, arm: str, b: int) -> float:
        """`factor`, shrunk toward its prior (`prior`: the bucket's laps' tail at its spread, or the bucket's
        pooled factor) by `PRIOR` pseudo-laps; for an arm with no lap of its own at b, the prior (as neutral a
        comparison as the laps allow, until it runs batches of its own), or 1. A lap's tail is mostly its text's
        (one row that accepts nothing for ten steps): at batch 16 (bf16) eagle-g4's laps ranged 0.59-0.89, and one
        lap of eagle-g2's read 0.90 against g4's 0.75 while the fixed engines' tails were alike (0.91 of their full
        steps' rate each): g4, 10% faster, lost the batch on one lap."""
        prior = self.prior(arm, b)
        d = self.done.get((arm, b))
        if not d:
            return prior
        return (len(d) * self.factor(arm, b) + self.PRIOR * prior) / (len(d) + self.PRIOR)

    def priced(self, arm: str, b: int, kappa: float) -> float:
        """What `arm`'s credited tokens/s at bucket b are worth in realized whole-batch tokens/s: with laps of its own
        there, their realized tokens/s over their peak steps' credited tokens/s (the tail and the credit's error at
        this batch size, both as measured), shrunk by `PRIOR` pseudo-laps toward `kappa` (its calibration over all its
        steps) × its prior tail factor (`prior`); without, that prior (`of`)."""
        d = self.done.get((arm, b))
        if not d:
            return kappa * self.of(arm, b)
        t, s, pc, ps = (sum(x[i] for x in d) for i in (0, 1, 4, 3))
        return (len(d) * (t / s) / (pc / ps) + self.PRIOR * kappa * self.prior(arm, b)) / (len(d) + self.PRIOR)

    def state(self) -> dict:
        """What `warm` reads back: per arm@bucket, its laps' (tokens, seconds, peak tokens, peak seconds) summed, how
        many laps, and their peak credit summed."""
        return {f"{a}@{b}": [*(sum(x[i] for x in d) for i in range(4)), len(d), sum(x[4] for x in d)]
                for (a, b), d in self.done.items() if d}

    def warm(self, state: dict) -> None:
        """Start from remembered laps, as many as there were, each their mean (this run's own push them out); laps
        remembered without their credit are credited with their peak tokens."""
        for k, v in state.items():
            try:
                arm, b = k.rsplit("@", 1)
                x = tuple(float(y) for y in v[:4])
                n = min(self.KEEP, max(1, int(v[4]))) if len(v) > 4 else 1
                x += (float(v[5]) if len(v) > 5 else x[2],)
                b = int(b)
            except (TypeError, ValueError, IndexError, AttributeError):
                continue
            if len(x) == 5 and min(x) > 0:
                self.done[(arm, b)] = deque([tuple(y / n for y in x)] * n, maxlen=self.KEEP)

    def stats(self) -> dict:
        """Per arm@bucket with laps of its own: the factor its rate is priced with (`of`)."""
        return {f"{a}@{b}": round(self.of(a, b), 4) for (a, b) in sorted(self.done) if self.done[(a, b)]}
