"""`auto`'s choice by measurement: which configuration (an *arm*: a plain step, or a speculative plan of one drafter
or drafter mix, its per-row draft lengths priced by the cost model) a step takes is decided by the tokens per second
each arm has realized in this process at this batch bucket, not by the predicted rates (which stay 15-44% off per
step kind). The cost model seeds the order in which unmeasured arms are tried (its best first), prunes the arms it
predicts far behind the best (`PRUNE`; never plain, the baseline auto must not lose to), and picks the arm while
nothing is measured at this batch bucket or a neighbouring one; it never overrides a measured comparison.

Successive elimination with a bounded budget:
- an arm counts as measured at a bucket after `min_steps` of its steps there (the first step after a switch to it
  is not counted: it pays the switch's catch-up, which the arm's steady state does not);
- exploitation: the measured arm with the highest rate (the current one stays unless another measures `STAY`×
  faster: near a tie, flipping pays catch-ups and follows noise); before any arm is measured at this bucket, the
  best measured at the nearest bucket; before that, the model's best;
- exploration, in bursts of `min_steps` + 1 consecutive steps of one arm: an unmeasured arm (most promising
  predicted first), a measured one flagged by drift, one measured `STALE` steps ago while close to the best, or one measured on few steps that is nearly tied; free during the first `WARMUP` steps, afterwards
  only while exploration steps stay within `SHARE` of the steps after the warm-up;
- drift: when the exploited arm's recent rate leaves its reference by more than `DRIFT`, the other arms at the
  bucket are flagged stale (re-measured within the budget); a batch bucket not seen yet starts unmeasured.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from specmoe.decoding.control.refinement import bucket


@dataclass
class Arm:
    """A configuration offered this step: its name ("plain", a drafter or drafter mix such as "eagle+ngram") and
    the cost model's predicted tokens/s (unbiased, and upper-confidence over the acceptance estimates)."""
    name: str
    predicted: float
    optimistic: float


@dataclass
class Pick:
    arm: str
    reason: str  # "measured" | "measured-near" | "model" | "explore"


@dataclass
class _Burst:
    arm: str
    bucket: int
    left: int


@dataclass
class MeasuredArms:
    """Realized tokens/s per (arm, batch bucket) and the bandit over them (module docstring)."""
    min_steps: int = 4       # steps an arm needs at a bucket before its rate counts (0: never explore)
    WINDOW: int = 32         # the last steps an arm's rate is taken over (ratio of sums: tokens / seconds)
    WARMUP: int = 64         # steps in which exploration is free
    SHARE: float = 0.04      # exploration steps / steps after the warm-up, at most (the target is 5%)
    PRUNE: float = 0.6       # arms predicted (upper-confidence) below this share of the best are not explored
    STAY: float = 1.03
    STALE: int = 512         # steps after which a measurement close to the best is taken again
    CLOSE: float = 0.85      # "close to the best" for re-measuring a stale arm
    DRIFT: float = 0.25
    RECENT: int = 8
    win: dict = field(default_factory=dict)        # (arm, bucket) -> deque[(tokens, seconds)]
    last: dict = field(default_factory=dict)       # (arm, bucket) -> step last measured
    ref: dict = field(default_factory=dict)        # (arm, bucket) -> its rate when last compared with the others
    stale: set = field(default_factory=set)        # (arm, bucket) flagged by drift
    current: dict = field(default_factory=dict)    # bucket -> the exploited arm
    steps: int = 0                                 # steps chosen (`tick`)
    explored: int = 0                              # exploration steps after the warm-up
    explored_all: int = 0
    chosen: dict = field(default_factory=dict)     # arm -> steps it was chosen
    prev: str | None = None                        # the last step's arm (a switch's first step is not measured)
    burst: _Burst | None = None

    # ------------------------------------------------------------ measurements
    def record(self, arm: str, B: int, tokens: float, seconds: float, step: int) -> None:
        """One step of `arm` at batch B emitted `tokens` in `seconds` (its whole cycle as the decoder measured it)."""
        switched, self.prev = self.prev is not None and self.prev != arm, arm
        if switched or tokens <= 0 or seconds <= 0:
            return
        key = (arm, bucket(B))
        w = self.win.setdefault(key, deque(maxlen=self.WINDOW))
        w.append((float(tokens), float(seconds)))
        self.last[key] = step
        self.stale.discard(key)
        if len(w) == self.min_steps or key not in self.ref:
            self.ref[key] = self.rate_of(key)
        elif self.current.get(key[1]) == arm and len(w) >= self.RECENT:
            recent = list(w)[-self.RECENT:]
            r = sum(t for t, _ in recent) / sum(s for _, s in recent)
            if abs(r / self.ref[key] - 1.0) > self.DRIFT:  # the workload moved: the others' rates are old news
                self.stale |= {k for k in self.win if k[1] == key[1] and k[0] != arm}
                self.ref[key] = r

    def interrupt(self) -> None:
        """A step of no arm (forced or scheduled): the next arm's first step is a switch."""
        self.prev = "-"

    def rate_of(self, key) -> float:
        w = self.win[key]
        return sum(t for t, _ in w) / sum(s for _, s in w)

    def rate(self, arm: str, B: int) -> float | None:
        """The arm's measured tokens/s at B's bucket (None until `min_steps` steps are measured there)."""
        key = (arm, bucket(B))
        return self.rate_of(key) if len(self.win.get(key, ())) >= max(1, self.min_steps) else None

    def n(self, arm: str, b: int) -> int:
        return len(self.win.get((arm, b), ()))

    # ------------------------------------------------------------ the choice
    def pick(self, arms: list[Arm], B: int) -> Pick:
        """The arm this step takes among `arms` (module docstring); counts the step."""
        b = bucket(B)
        exploit = self._exploit(arms, b)
        if len(arms) > 1:  # (plain alone, e.g. at a sequence's last token, is no choice)
            self.current[b] = exploit.arm
        x = self._explore(arms, b, exploit.arm)
        pick = Pick(x, "explore") if x is not None else exploit
        self.steps += 1
        if pick.reason == "explore":
            self.explored_all += 1
            self.explored += self.steps > self.WARMUP
        self.chosen[pick.arm] = self.chosen.get(pick.arm, 0) + 1
        return pick

    def note(self, arm: str) -> None:
        """A step this object did not choose (a reused call, a forced or scheduled step): counted, not explored."""
        self.steps += 1
        self.chosen[arm] = self.chosen.get(arm, 0) + 1
        if self.burst is not None and self.burst.arm != arm:
            self.burst = None

    def _exploit(self, arms: list[Arm], b: int) -> Pick:
        names = [a.name for a in arms]
        measured = {n: self.rate_of((n, b)) for n in names if self.n(n, b) >= max(1, self.min_steps)}
        if measured:
            best = max(measured, key=measured.get)
            cur = self.current.get(b)
            if cur in measured and measured[cur] * self.STAY >= measured[best]:
                best = cur
            return Pick(best, "measured")
        near = sorted({k[1] for k in self.win if k[1] != b}, key=lambda k: abs(math.log2(k / b)))
        for nb in near:
            there = {n: self.rate_of((n, nb)) for n in names if self.n(n, nb) >= max(1, self.min_steps)}
            if there:
                return Pick(max(there, key=there.get), "measured-near")
        return Pick(max(arms, key=lambda a: a.predicted).name, "model")

    def _budget(self, steps: int) -> bool:
        """Whether `steps` more exploration steps keep the share after the warm-up within SHARE."""
        after = self.steps + steps - self.WARMUP
        return after <= 0 or self.explored + steps <= self.SHARE * after

    def _explore(self, arms: list[Arm], b: int, best: str) -> str | None:
        if not self.min_steps:
            return None
        offered = {a.name for a in arms}
        if self.burst is not None:  # a burst runs to its end while its arm is offered at its bucket
            bu = self.burst
            if bu.bucket == b and bu.arm in offered and bu.arm != best and bu.left > 0:
                bu.left -= 1
                return bu.arm
            self.burst = None
        target, again = self._target(arms, b, best)
        if target is None:
            return None
        # + the switch's unmeasured step; an arm measured again starts a fresh window (its old steps are old news)
        length = self.min_steps + 1 - (0 if again else min(self.n(target, b), self.min_steps))
        if not self._budget(length):
            return None
        if again:
            self.win[(target, b)].clear()
        self.burst = _Burst(target, b, length - 1)
        return target

    def _target(self, arms: list[Arm], b: int, best: str) -> tuple[str | None, bool]:
        """The arm to explore, and whether it is measured again from scratch (drift, or an old measurement)."""
        if self.n(best, b) < self.min_steps:  # the exploited arm is being measured first
            return None, False
        top = max(a.predicted for a in arms)
        cands = [a for a in arms if a.name != best and (a.name == "plain" or a.optimistic >= self.PRUNE * top)]
        unmeasured = [a for a in cands if self.n(a.name, b) < self.min_steps]
        if unmeasured:  # the model seeds the order
            return max(unmeasured, key=lambda a: a.optimistic).name, False
        rb = self.rate_of((best, b))
        # flagged by drift: every arm (its rate is old news); merely old: those close to the best
        old = [a.name for a in cands if (a.name, b) in self.stale
               or (self.steps - self.last.get((a.name, b), 0) > self.STALE
                   and self.rate_of((a.name, b)) >= self.CLOSE * rb)]
        if old:
            return min(old, key=lambda n: self.last.get((n, b), 0)), True
        few = [a.name for a in cands if self.n(a.name, b) < 2 * self.min_steps
               and self.rate_of((a.name, b)) >= rb / self.STAY]
        return (few[0], False) if few else (None, False)

    # ------------------------------------------------------------ read out, persist
    def exploration_share(self) -> float:
        """Exploration steps over the steps after the warm-up."""
        after = self.steps - self.WARMUP
        return self.explored / after if after > 0 else 0.0

    def stats(self) -> dict:
        return {"auto_chosen": max(self.chosen, key=self.chosen.get) if self.chosen else None,
                "auto_chosen_steps": dict(self.chosen),
                "auto_current_by_bucket": {str(b): a for b, a in sorted(self.current.items())},
                "auto_exploration_share": round(self.exploration_share(), 4),
                "auto_exploration_steps": self.explored_all,
                "auto_measured_rates": {f"{a}@{b}": round(self.rate_of((a, b)), 2)
                                        for (a, b) in sorted(self.win) if self.win[(a, b)]},
                "auto_measured_steps": {f"{a}@{b}": len(w) for (a, b), w in sorted(self.win.items())}}

    def state(self) -> dict:
        """What `warm` reads back: each arm's measured (tokens, seconds) per bucket, summed over its window."""
        return {f"{a}@{b}": [sum(t for t, _ in w), sum(s for _, s in w), len(w)]
                for (a, b), w in self.win.items() if w}

    def warm(self, state: dict) -> None:
        """Start from remembered rates as `min_steps` measured steps at step 0 (stale after `STALE` steps; this
        run's own steps push them out of the window)."""
        for k, v in state.items():
            try:
                arm, b = k.rsplit("@", 1)
                tokens, seconds, n = float(v[0]), float(v[1]), int(v[2])
            except (TypeError, ValueError, IndexError):
                continue
            if tokens <= 0 or seconds <= 0 or n < max(1, self.min_steps):
                continue
            k2 = max(1, self.min_steps)
            self.win[(arm, int(b))] = deque([(tokens / n, seconds / n)] * k2, maxlen=self.WINDOW)
            self.last[(arm, int(b))] = 0
            self.ref[(arm, int(b))] = tokens / seconds
