"""`auto`'s choice by measurement: which configuration (an *arm*: a plain step, a drafter's fixed configuration, a
drafter mixed with a lookup drafter, or with `Controller.PER_ROW` a drafter's per-row lengths priced by the cost
model) a step takes is decided by the tokens per second each arm has realized in this process at this batch bucket,
not by the predicted rates (which stay 15-44% off per step kind). The cost model orders the trials of unmeasured
arms (after plain and the exploited arm's drafter: its best first), prunes the arms it
predicts far behind the best offered on every step (`PRUNE`; never plain, the baseline auto must not lose to, nor
another length of a drafter measured at the bucket, `_kin`; not against a lookup arm's prediction, made on the
repetitive text it is offered on), and picks the arm while
nothing is measured at this batch bucket or a neighbouring one; it never overrides a measured comparison.

What each arm has realized, and what it is credited with, is kept by `rates.ArmRates` (its docstring).

Successive elimination with a bounded budget:
- an arm counts as measured at a bucket after `min_steps` of its steps there (half as many from `WIDE` rows on:
  `need`); the first step after a switch to it is not counted: it pays the switch's cold cache, which the arm's
  steady state does not (a drafter's catch-up, `Drafter.sync`, is left out of every step's seconds);
- exploitation: the current arm stays unless another measures `STAY`× faster *and* faster by more than `Z` standard
  errors of the two rates or over a full window (a step's tokens follow the text it lands on, so a few steps of an arm
  are a noisy sample: the best of many noisy rates is mostly the luckiest; an arm ahead is measured longer; a trial's
  steps share one moment, so a rate's standard error is at least the spread between moments that its window's
  bursts leave, `ArmRates.se_of`; and a challenger is taken only on a reading within the exploited arm's window,
  `_fresh`: an older one is measured again first); with no
  current arm, the measured arm of the highest lower confidence bound (rate − Z·se); before any arm is measured at
  this bucket, the best measured at the nearest bucket; before that, the model's best. A lookup arm (ngram, or a mix
  with it) is offered and measured only where its lookup matched, repetitive text on which every arm runs faster
  (eagle-g2 emits up to 1.3x its average there): its rate counts `EDGE`x less against the others (ngram-g4 at 385
  tok/s on its matched steps took batch 4 from eagle-g2 at 382 on all steps, while the fixed ngram-g4 engine ran well
  behind it). Arms compare on their steps of as many rows (`_rows`: a trial runs at a batch's start, the exploited arm
  over its whole life), and the shortest draft length of the chosen arm's drafter measured within `STAY` of it is
  taken (`_even`: deeper drafts leave a longer ragged tail, which per-step rates do not see, and their credit leans on
  the deep positions' estimates, which read high); once an arm has run whole batches at a bucket, its rate there is
  priced by them (`laps`: whole batches' realized tokens/s over their full steps' credited). (Rates relative to the
  exploited arm's adjacent steps were tried and dropped: a burst's tokens per step follow the text it lands on more
  than the machine's speed, and chained ratios compounded that noise);
- exploration, in bursts of `need` + 1 consecutive steps of one arm, in this order: an unmeasured plain (the baseline)
  or another length or shape of the exploited arm's drafter (whose acceptance is measured where the others' is only
  predicted: at batch 64 the model ranked eagle-g2 last of 7 and the budget ran out before its trial, though it
  measures 8% faster than the exploited eagle-g4); one measured above `STAY` × the exploited arm on a window not clear
  yet (a burst more added to its window, until clear or full, within `SECOND_SHARE`: an arm ahead is the likeliest
  to pay for its trials); a measured arm flagged by drift, or measured `STALE`
  steps ago while close to the best (within `SECOND` of it for another length of the exploited arm's drafter; a
  re-measure starts a fresh window); one whose single trial put
  it behind the best but within `SECOND` of it (a second opinion, `RECENT` steps later: the better of its two trials
  stands; before the first trials of other drafters, which the model ranked lower: a trial of 4 steps can meet a slow
  moment); another drafter's unmeasured arm, the most promising predicted first (not one of a drafter whose measured
  lengths all read below `FAR` × the best: `_far`); or one measured on few steps that is nearly tied; no trial starts
  while the batch's rows are in their first `YOUNG` tokens (a request's first tokens run slower on every arm, its
  experts not cached yet: at batch 1 on the demo model eagle-g2 emitted 225 tok/s over a request's first 8 tokens and
  287 over the rest, eagle-g4 225 and 319, and trials, which started at a fresh plan and so often at a request's
  start, rated eagle-g2 at 206 tok/s against the exploited eagle-g4's 280 while its fixed engine ran 6% faster than
  eagle-g4's), and those first steps are in no arm's window (`ArmRates.record`: an exploited arm and a trial are rated
  on steps of the same kind): a trial due then is put off, the exploited arm's call reused only a few steps so the
  next fresh plan starts it (`deferred_at`); free during the first `WARMUP` steps, afterwards only while exploration
  steps stay within `SHARE` of the steps after the warm-up (a second opinion within `SECOND_SHARE`, still under the 5%
  target);
- a bucket is explored only while it is the largest of the last 2·`SETTLE` steps' or at least `SETTLE` of them were in
  it, and none of them in a bucket more than twice as large (or while nothing is measured anywhere; a batch of 64
  whose ragged tail ran 17 of its 27 steps never spent 8 of 16 steps at 64, and eagle-g2 was never tried there): a
  passing batch size, such as a batch's ragged tail (64 sequences, then 40, 17, 5, 1: a speculative batch's rows
  finish steps apart, and its last row can run 10+ steps alone), exploits the nearest measured bucket's best arm
  instead of paying trials it could never amortize (and that spent the budget the batch's own bucket needed); at a new
  bucket, an arm measured below `NEAR` × the best at a neighbouring bucket (within a factor 4) is not tried until the
  batch has stayed `NEAR_AFTER` steps there;
- drift: when the exploited arm's rate over its last `RECENT` steps differs from its rate over the `RECENT` steps
  before them by more than `DRIFT` and by more than two standard errors of that difference (at batch 1 a step's
  tokens swing 1-5 with the text: 8 steps' rate swung 2x with nothing changed, and each false drift sent the budget
  re-measuring every arm), the other arms at the bucket are flagged stale (re-measured within the budget, the
  closest to the best first; those measured below `FAR` × its lower rate stay as measured), the exploited arm keeps
  only its last `RECENT` steps, a reused call ends (the next step plans: at batch 1 eagle-g4 led eagle-g2 by 12% on
  one text and trailed it by 5% on the next), and the next check waits `RECENT` steps; a trial cut short because its
  arm was not offered (a lookup drafter without a match) is not tried again there for `STALE` steps (a lookup arm
  offered on one step in three never completed a trial and took the budget over and over); a batch bucket not seen
  yet starts unmeasured.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from specmoe.decoding.control.candidates import LOOKUP, is_uniform, uniform_parts
from specmoe.decoding.control.rates import ArmRates
from specmoe.decoding.control.refinement import bucket


def drafter(arm: str) -> str:
    """The drafter (mix) an arm drafts with: "eagle" of "eagle-g2", "eagle/tree" and "eagle"; "eagle+ngram"."""
    return arm.split("/")[0].split("-g")[0]


def conditional(arm: str) -> bool:
    """Whether an arm drafts with a lookup drafter (`candidates.LOOKUP`: "ngram-g4", "eagle+ngram"): it is offered
    only on steps where the lookup has a proposal, repetitive text that lifts every arm, so its rate is no yardstick
    for arms measured on every step."""
    return any(d in LOOKUP for d in drafter(arm).split("+"))


@dataclass
class Arm:
    """A configuration offered this step: its name ("plain", a drafter or drafter mix such as "eagle+ngram"), the
    cost model's predicted tokens/s (unbiased, and upper-confidence over the acceptance estimates) and, where known,
    the spread of a row's tokens per step (`laps.spread`: what a batch's ragged tail costs it before it has run
    batches of its own; None for a mix, a tree or per-row lengths)."""
    name: str
    predicted: float
    optimistic: float
    spread: float | None = None


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
class MeasuredArms(ArmRates):
    """The bandit over the arms' realized tokens/s per batch bucket (`ArmRates`; module docstring)."""
    WARMUP: int = 64         # steps in which exploration is free
    SHARE: float = 0.04      # exploration steps / steps after the warm-up, at most (the target is 5%) ...
    SECOND_SHARE: float = 0.048  # ... and for a second opinion (`_target`), which the budget serves first
    PRUNE: float = 0.6       # arms predicted (upper-confidence) below this share of the best are not explored
    STAY: float = 1.03
    STALE: int = 512         # steps after which a measurement close to the best is taken again
    CLOSE: float = 0.85      # "close to the best" for re-measuring a stale arm
    Z: float = 1.0           # standard errors a challenger's rate must clear to replace the exploited arm
    NEAR: float = 0.75       # an arm measured below this share of the best at a neighbouring bucket is not tried ...
    NEAR_AFTER: int = 256    # ... until the batch has stayed this many steps in the new bucket
    EDGE: float = 1.25       # a lookup arm exploited only when it measures this much faster (`_edge`)
    SECOND: float = 0.6      # an arm whose one trial measured it behind the best, within this share, is tried again
    YOUNG: int = 8           # no trial starts while the batch's rows have generated fewer tokens than this (mean)
    cut: dict = field(default_factory=dict)        # (arm, bucket) -> step its last trial was cut short
    steps: int = 0                                 # steps chosen (`tick`)
    explored: int = 0                              # exploration steps after the warm-up
    explored_all: int = 0
    chosen: dict = field(default_factory=dict)     # arm -> steps it was chosen
    burst: _Burst | None = None
    idle: dict = field(default_factory=dict)       # bucket -> its last pick found no arm to explore (`settled`)
    deferred: dict = field(default_factory=dict)   # bucket -> its last pick put a due trial off (`deferred_at`)

    # ------------------------------------------------------------ the choice
    def pick(self, arms: list[Arm], B: int, young: bool = False) -> Pick:
        """The arm this step takes among `arms` (module docstring); counts the step. `young`: the batch's rows are
        in their first `YOUNG` tokens, where no trial starts (`_explore`)."""
        b = bucket(B)
        self.laps.spreads.update({a.name: a.spread for a in arms if a.spread is not None})
        exploit = self._exploit(arms, b)
        if len(arms) > 1:  # (plain alone, e.g. at a sequence's last token, is no choice)
            self.current[b] = exploit.arm
        x = self._explore(arms, b, exploit.arm, young)
        pick = Pick(x, "explore") if x is not None else exploit
        self.steps += 1
        if pick.reason == "explore":
            self.explored_all += 1
            self.explored += self.steps > self.WARMUP
        self.chosen[pick.arm] = self.chosen.get(pick.arm, 0) + 1
        return pick

    def deferred_at(self, B: int) -> bool:
        """Whether the last pick at B's bucket put off a trial that was due because the rows were in their first
        `YOUNG` tokens: the exploited arm's call is reused only a few steps (`Coasting._measured_coast`), so a
        fresh plan past those tokens starts it (reused for `coast_max` steps, the next fresh plan at batch 64 fell
        in the batch's tail, and no trial ever started at its full size: eagle-g2 was never measured there while
        the fixed eagle-g2 ran 10% faster than the exploited eagle-g4)."""
        return self.deferred.get(bucket(B), False)

    def settled(self, B: int) -> bool:
        """Whether the last pick at B's bucket found no arm worth exploring (every arm measured, none stale or
        nearly tied): the exploited arm's call may be reused longer (`Coasting._measured_coast`)."""
        return self.idle.get(bucket(B), False)

    def note(self, arm: str) -> None:
        """A step this object did not choose (a reused call, a forced or scheduled step): counted, not explored."""
        self.steps += 1
        self.chosen[arm] = self.chosen.get(arm, 0) + 1
        if self.burst is not None and self.burst.arm != arm:
            self.burst = None

    def trial_left(self, arm: str, B: int) -> int:
        """Steps the running exploration burst of `arm` at B's bucket has left after this one (0: none running)."""
        bu = self.burst
        return bu.left if bu is not None and bu.arm == arm and bu.bucket == bucket(B) else 0

    def trial_step(self, arm: str, B: int) -> bool:
        """A step of the running burst taken by reusing its call (a trial of a fixed configuration or plain repeats
        its first step's plan: a fresh plan, ~1.5 ms, on each of a 10 ms trial's steps cost it 15%): counted as the
        pick would count it (an exploration step, one less left). False when no such burst runs."""
        if self.trial_left(arm, B) <= 0:
            return False
        self.burst.left -= 1
        self.steps += 1
        self.explored_all += 1
        self.explored += self.steps > self.WARMUP
        self.chosen[arm] = self.chosen.get(arm, 0) + 1
        return True

    def _edge(self, arm: str) -> float:
        """What an arm's rate is divided by when arms are compared: `EDGE` for a lookup arm (`conditional`: measured
        only on the repetitive text where its lookup matched, text on which every arm runs faster), else 1."""
        return self.EDGE if conditional(arm) else 1.0

    def _exploit(self, arms: list[Arm], b: int) -> Pick:
        names = [a.name for a in arms]
        f = self._rows(names, b)
        measured = {n: r / self._edge(n) for n in names if (r := self.score(n, b, f)) is not None}
        if measured:
            cur = self.current.get(b)
            se = {n: self.se_of((n, b), f) / self._edge(n) for n in measured}
            if cur not in measured:
                return Pick(self._even(max(measured, key=lambda n: measured[n] - self.Z * se[n]), measured),
                            "measured")
            best = max(measured, key=measured.get)
            gap = measured[best] - measured[cur]
            # clear by Z standard errors, or over a window as full as the exploited arm's (`_target`'s "ahead"
            # bursts fill the window of an arm measured ahead: as measured as it can be, its lead stands). A lead
            # held over 16 steps was tried (2a17e8d): it took eagle-g4 at demo bf16 batch 1 (0.89 -> 1.00x the best
            # fixed); with it auto also ran the slower eagle-g4 in demo fp32 batch 16's tail (eagle-g4 measured 12%
            # ahead over 20 steps at 8 rows; 1.05 -> 0.94x) and plain for 126 of a round's 284 steps on the widened
            # copy at batch 1 (bf16, `moment_cv` 0.28): at a moment spread of 0.1-0.3, a 3% lead over 4 moments is
            # within one standard error of the difference
            clear = gap > self.Z * math.hypot(se[best], se[cur]) or self.n(best, b) >= self.WINDOW
            take = measured[best] > self.STAY * measured[cur] and clear and self._fresh(best, b)
            return Pick(self._even(best if take else cur, measured), "measured")
        near = sorted({k[1] for k in self.win if k[1] != b}, key=lambda k: abs(math.log2(k / b)))
        for nb in near:
            there = {n: r for n in names if (r := self.score(n, nb)) is not None}
            if there:
                return Pick(max(there, key=there.get), "measured-near")
        return Pick(max(arms, key=lambda a: a.predicted).name, "model")

    def _fresh(self, arm: str, b: int) -> bool:
        """Whether `arm` was last measured at bucket b within the exploited arm's window there: a reading older than
        that window compares two moments of the machine, not two arms (this machine's speed swings up to 1.5x
        between runs a few seconds apart: at demo fp32 batch 4 plain's 4-step trial read 383 tok/s beside the
        exploited eagle-g2's 380; 58 steps later, a slower round, eagle-g2's window read 323, plain's old reading
        took the batch, and plain then ran at 258). An old reading ahead is measured again first (`_target`)."""
        since = self.since(self.current.get(b), b)
        return since is None or self.last.get((arm, b), -1) >= since

    def _even(self, arm: str, measured: dict) -> str:
        """The shortest fixed length of `arm`'s drafter measured as fast as it (within `STAY`). At a batch, deeper
        drafts finish its rows further apart, and its ragged tail runs fewer rows a step at a worse rate than its
        full steps, which per-step rates do not see (at batch 64 eagle-g4's full steps measured 2% faster than
        eagle-g2's, its tail took 1.65x as long and the batch 8% longer). At any batch, a deeper draft is credited
        with what its deep positions' estimates say they are worth, and those read high (at batch 1 on the demo
        model eagle-g4's steps emitted 0.92x the tokens they were credited with over 370 steps, its calibration
        still at 0.94 after them: it measured 231-248 tok/s against eagle-g2's 239-244 while the fixed engines ran
        eagle-g2 3-8% faster; in 13 of 16 points of the auto bench the fixed eagle-g2 ran at least as fast)."""
        if not is_uniform(arm):
            return arm
        d, g = uniform_parts(arm)
        tied = {n: uniform_parts(n)[1] for n in measured if is_uniform(n) and uniform_parts(n)[0] == d
                and uniform_parts(n)[1] < g and self.STAY * measured[n] >= measured[arm]}
        return min(tied, key=tied.get) if tied else arm

    def _budget(self, steps: int, share: float | None = None) -> bool:
        """Whether `steps` more exploration steps keep the share after the warm-up within `share` (SHARE)."""
        after = self.steps + steps - self.WARMUP
        return after <= 0 or self.explored + steps <= (self.SHARE if share is None else share) * after

    def _explore(self, arms: list[Arm], b: int, best: str, young: bool = False) -> str | None:
        tail = max(self.recent, default=b) > 2 * b  # the ragged tail of a batch more than twice as large
        peak = b >= max(self.recent, default=b)  # the largest bucket of the last steps: no size passed on the way down
        self.deferred[b] = False  # (set again below only by this pick's own deferral: `deferred_at`)
        if not self.min_steps or ((self.recent.count(b) < self.SETTLE and not peak or tail) and any(self.win.values())):
            return None
        offered = {a.name for a in arms}
        self.idle[b] = False
        if self.burst is not None:  # a burst runs to its end while its arm is offered at its bucket
            bu = self.burst
            if bu.bucket == b and bu.arm in offered and bu.arm != best and bu.left > 0:
                bu.left -= 1
                return bu.arm
            if bu.bucket == b and bu.arm not in offered and bu.left > 0 and conditional(bu.arm) and len(arms) > 1:
                self.cut[(bu.arm, b)] = self.steps  # cut short: a lookup without a match (not a request's end)
            self.burst = None
        target, mode = self._target(arms, b, best)
        self.idle[b] = target is None and self.n(best, b) >= self.need(b)  # (not: the exploited arm measured first)
        if target is None:
            return None
        # + the switch's unmeasured step; an arm measured again starts a fresh window (its old steps are old news),
        # one measured more adds a burst to it
        length = self.need(b) + 1 - (min(self.n(target, b), self.need(b)) if mode == "new" else 0)
        # a second opinion may take the budget a little further: one 4-step trial at batch 1 can meet the stalls
        # of a few expert misses (on the widened copy eagle-g2's one trial read 25 tok/s against eagle-g4's 38 while
        # the fixed engines ran 46 and 41), and at SHARE its second opinion found no room in 240 steps
        # and so may the bursts that measure a lead (an arm ahead is the likeliest to pay for its trials; at 4% the
        # budget bought about one burst a round at batch 1, and a lead took several rounds to fill its window)
        due = self._budget(length, self.SECOND_SHARE if mode in ("second", "ahead", "recheck") else None)
        # a request's first tokens run slower on every arm: a trial due now starts once the rows are past them, and
        # the exploited arm's call is reused only until then (`deferred`)
        self.deferred[b] = due and young
        if not due or young:
            return None
        if mode == "second":
            self.prior[(target, b)] = deque(self.win[(target, b)])
        if mode in ("again", "second", "recheck"):
            self.win[(target, b)].clear()
        self.burst = _Burst(target, b, length - 1)
        return target

    def _target(self, arms: list[Arm], b: int, best: str) -> tuple[str | None, str]:
        """The arm to explore, and how: "new" (not measured yet), "again" (from scratch: drift, or an old
        measurement), "second" (from scratch, the better of its two trials standing: `_trial_done`), "more" (a
        burst added to a noisy measurement), or for an arm measured ahead of the exploited one "ahead" (a burst
        added) or "recheck" (from scratch: its reading is older than the exploited arm's window, `_fresh`); a
        second opinion and a lead are served from the `SECOND_SHARE` budget."""
        if self.n(best, b) < self.need(b):  # the exploited arm is being measured first
            return None, ""
        # the best predicted among the arms offered on every step: a lookup arm is predicted (and measured) on the
        # repetitive text where it has a proposal, and its prediction there put every other arm below PRUNE of it
        top = max((a.predicted for a in arms if not conditional(a.name)), default=max(a.predicted for a in arms))
        f = self._rows([a.name for a in arms], b)
        rb = self.score(best, b, f) or 0.0
        kin, far = self._kin(b), self._far(b, rb)
        kept = [a for a in arms if a.name == "plain" or a.optimistic >= self.PRUNE * top
                or is_uniform(a.name) and drafter(a.name) in kin]
        cands = [a for a in kept
                 if a.name != best and self.steps - self.cut.get((a.name, b), -self.STALE) >= self.STALE
                 and not (drafter(a.name) in far and self.n(a.name, b) < self.need(b))]
        unmeasured = [a for a in cands if self.n(a.name, b) < self.need(b)
                      and (a.name == "plain" or not self._behind_near(a.name, b))]
        # plain (the baseline) first, then the exploited arm's drafter, then in the model's order
        first = max(unmeasured, key=lambda a: (a.name == "plain", drafter(a.name) == drafter(best), a.optimistic),
                    default=None)
        if first is not None and (first.name == "plain" or drafter(first.name) == drafter(best)):
            return first.name, "new"
        # measured ahead of the exploited arm (by `STAY`) but not clearly (a short window: `_exploit` keeps it):
        # measured longer before anything else is re-measured, until it is clear or its window is full (at batch 4
        # eagle-g2's one trial read 7% above the exploited eagle-g4, and the budget of 160 steps went to
        # re-measuring a lookup mix flagged by drift, while the fixed eagle-g2 ran 9% faster; with these bursts capped
        # at 3 × `need` steps, plain ran 85% of 5 rounds' steps at batch 4 while the fixed eagle-g4 ran 1.17x the AR
        # baseline, and eagle-g4 ended measured 14% ahead of plain over 15 steps)
        ahead = {a.name: r for a in cands if self.need(b) <= self.n(a.name, b) < self.WINDOW
                 and (r := (self.score(a.name, b, f) or 0.0) / self._edge(a.name)) > self.STAY * rb / self._edge(best)}
        if ahead:  # (a reading older than the exploited arm's window is taken again from scratch: `_fresh`)
            a = max(ahead, key=ahead.get)
            return a, "ahead" if self._fresh(a, b) else "recheck"
        # flagged by drift: every arm (its rate is old news); merely old: those close to the best, or within SECOND
        # of it for another length of its drafter (whose acceptance is the exploited arm's: only its reading, a
        # few steps at one moment, put it behind)
        old = [a.name for a in cands if (a.name, b) in self.stale
               or (self.steps - self.last.get((a.name, b), 0) > self.STALE
                   and (self.score(a.name, b, f) or 0.0) >= (self.SECOND if drafter(a.name) == drafter(best)
                                                                 else self.CLOSE) * rb)]
        if old:  # the one measured closest to the best first (the likeliest to take over), then the oldest
            return max(old, key=lambda n: (self.score(n, b, f) or 0.0, -self.last.get((n, b), 0))), "again"
        # measured once, behind but within SECOND of the best, at least RECENT steps ago (another moment's stalls):
        # a second opinion, the closest first, before another drafter's first trial (the model ranked those below:
        # at batch 4 eagle-g2's one trial met a slow moment, 0.7x of eagle-g4, and the budget after the warm-up went
        # to self+ngram's first trial while the fixed eagle-g2 ran 10% faster than the exploited eagle-g4)
        once = [a.name for a in cands if self.trials.get((a.name, b)) == 1 and (a.name, b) not in self.prior
                and self.steps - self.last.get((a.name, b), 0) >= self.RECENT
                and self.SECOND * rb <= (self.score(a.name, b, f) or 0.0) < rb]
        if once:
            return max(once, key=lambda n: self.score(n, b, f) or 0.0), "second"
        if first is not None:
            return first.name, "new"
        # nearly tied or not clearly behind (upper confidence bound reaching the exploited rate): measured longer
        few = [a.name for a in cands if self.n(a.name, b) < 3 * self.need(b)
               and (self.score(a.name, b, f) or 0.0) + self.Z * self.se_of((a.name, b), f) >= rb]
        return (few[0], "more") if few else (None, "")

    def _kin(self, b: int) -> set[str]:
        """The drafters with a fixed configuration measured at bucket b: their other lengths are never pruned there
        (their acceptance is measured, and the model's step times are what misjudged them: on the widened copy at
        batch 16 it predicted eagle-g2 at 0.56x eagle-g4, pruned it, and ran plain after eagle-g4's whole batches
        priced it at 0.64x, while the fixed eagle-g2 engine ran at least as fast as eagle-g4's)."""
        return {drafter(n) for (n, k), w in self.win.items() if k == b and w and is_uniform(n)}

    def _far(self, b: int, rb: float) -> set[str]:
        """The drafters whose fixed configurations measured at bucket b all read below `FAR` × the best's rate rb
        there: their unmeasured lengths are not tried (at batch 1 on the demo model self-g2 measured 0.42x the
        exploited eagle-g2, and self-g4's first trial then took 5 of a round's 52 steps at 0.4x: the round ran
        0.84x the fixed eagle-g2). Not lookup drafters (measured on the repetitive text they are offered on)."""
        best: dict[str, float] = {}
        for (n, k), w in self.win.items():
            if k == b and w and is_uniform(n) and not conditional(n) and (r := self.score(n, b)) is not None:
                best[drafter(n)] = max(best.get(drafter(n), 0.0), r)
        return {d for d, r in best.items() if r < self.FAR * rb}

    def _behind_near(self, arm: str, b: int) -> bool:
        """Whether `arm` measured below `NEAR` × the best arm at the nearest bucket (within a factor 4 of b) where
        it was measured: not worth a trial here (plain is always tried: the baseline) unless the batch has stayed
        `NEAR_AFTER` steps in this bucket (a workload that settles here can afford to check). The best there is
        taken over the arms offered on every step (not `conditional` ones: a lookup arm measured 2x eagle's rate at
        batch 1 on the text it is offered on, and kept eagle's short drafts from being tried at batch 4). Between
        `FAR` and `NEAR` of the best, one short trial there is not enough to rule it out here: it takes more than
        `need` steps of it or a second trial (a 4-step trial at batch 1 read eagle-g2 at 177 tok/s, 0.70x of
        eagle-g4, while its fixed engine ran 5% faster than eagle-g4's, and kept it from being tried at batch 4)."""
        if self.seen.get(b, 0) >= self.NEAR_AFTER:
            return False
        near = sorted({k[1] for k in self.win if k[0] == arm and k[1] != b and max(k[1], b) <= 4 * min(k[1], b)},
                      key=lambda k: abs(math.log2(k / b)))
        for nb in near:
            mine = self.score(arm, nb)
            best = max((r for (a, k) in self.win if k == nb and not conditional(a)
                        and (r := self.score(a, nb)) is not None), default=None)
            if mine is not None and best:
                solid = self.n(arm, nb) > self.need(nb) or self.trials.get((arm, nb), 0) >= 2
                return mine < self.FAR * best or (mine < self.NEAR * best and solid)
        return False

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
                "auto_second_trials": self.second_trials,
                "auto_lap_factors": self.laps.stats(),
                # realized whole-batch tokens per credited token each arm with laps of its own is priced by (`scale`)
                "auto_lap_pricing": {f"{a}@{b}": round(self.scale(a, b), 4) for (a, b) in sorted(self.laps.done)
                                     if self.laps.done[(a, b)]},
                "auto_measured_rates": {f"{a}@{b}": round(self.rate_of((a, b)), 2)
                                        for (a, b) in sorted(self.win) if self.win[(a, b)]},
                "auto_measured_steps": {f"{a}@{b}": len(w) for (a, b), w in sorted(self.win.items())},
                # per bucket: the spread between moments that floors a rate's standard error (`ArmRates.se_of`)
                "auto_moment_cv": {str(b): round(cv, 4) for b in sorted(self.current)
                                   if (cv := self.moment_cv(b)) is not None},
                "auto_arm_calibration": {a: round(self.kappa(a), 4) for a in sorted(self.real)},
                # per bucket: the exploited arm's recent and long-run wait per expert lookup (ms) and how far the
                # moment's excess foretold its next step (`MissMoment`): what a trial's wait is credited by
                "auto_miss_moment": {str(b): {"arm": mo.arm, "beta": round(mo.beta(), 3),
                                              "ms_per_lookup": [round(1e3 * x, 4) for x in r]}
                                     for b, mo in sorted(self.moments.items()) if (r := mo.ratios()) is not None}}
