"""What each `auto` arm has realized per batch bucket, and what it is credited with (`ArmRates`).

An arm's rate is not the tokens its steps happened to emit: at batch 1 a step emits 1 to 5 tokens with the text it
lands on, so arms measured on different text (a few steps each) compared the text, not the arms. A chain step is
credited with what its drafts were worth on the drafter's acceptance pooled over every sequence (`expected`: the
position estimates at the depths it drafted), times the arm's calibration (`kappa`: tokens emitted per pooled token
over all its own steps, shrunk toward 1 while it has few), over the step's seconds. Plain and tree
steps, and every step of `WIDE` rows or more (it averages that many rows' text; `credits`), are credited with what
they emitted.

Nor is an arm's rate the expert misses its steps happened to meet: with experts offloaded, a step waits for the
experts its routing needs that the cache does not hold, and how many of those there are follows the moment (a
request's first steps, a topic change) as much as the arm. On the widened copy at batch 1 eagle-g2's steps, 3 tokens
each, took 28 ms in a run of hits and 100-140 ms in a run of misses, runs of 5-15 steps: a 4-step trial took
whichever run it met (25 tok/s against its fixed engine's 46). The moment is read off the exploited arm
(`MissMoment`): its wait per expert lookup over its last few steps against its long run. A step of another arm (a
trial) is credited its wait less its lookups × the moment's excess × how far that excess has foretold the
exploited arm's next step (`beta`: about 1 where misses come in runs, about 0 in independent bursts; in a run of
hits a trial is charged the long run's extra wait). The exploited arm's own steps stand as measured: its window
spans many moments, and crediting them by a moment they make up themselves is biased (with a miss burst on one
step in ten, such crediting read the arm 12% faster than it ran, and it held the bucket: demo batch 1 fell to
0.87-0.89x the best fixed engine). The excess is the exploited arm's per lookup, so a trial arm that misses more
per lookup is corrected less than its share: it errs against the trial, less than its raw seconds do. Each arm
keeps its own wait per lookup: over one trace plain waited 1.14 ms per expert it looked up, eagle-g2 0.96,
eagle-g4 0.78 (a deeper draft's verification loads experts the next tokens use); crediting every arm one pooled
wait per lookup rated plain 7% above its realized rate and eagle-g4 7% below, and `auto` ran plain for 96 of 222
steps.

Per (arm, bucket) a window of its last `WINDOW` steps, (credited tokens, seconds, rows, step); per arm its calibration
sums (`kappa`); per (arm, bucket) the whole batches it ran (`laps.Laps`), which price its rate there (`scale`). A
drift of the exploited arm's rate flags the others at its bucket stale (`record`; what the bandit does with that:
`measured`). All of it persists per machine, model and tier (`state`, `warm`).
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from specmoe.decoding.control.laps import Laps
from specmoe.decoding.control.refinement import bucket


@dataclass
class MissMoment:
    """The moment's expert misses at a batch bucket, read off the exploited arm's steps (`ArmRates.record`): its
    wait per expert lookup over its last steps (`SHORT` steps' half-life) against that over its long run (`LONG`),
    the excess a trial step's lookups are credited less (`credit`), as far as it has predicted the next step's
    (`beta`). Restarts when the exploited arm changes (each arm's wait per lookup is its own: module docstring);
    nothing is credited until `READY` of its steps are in."""
    SHORT: float = 3.0
    LONG: float = 128.0
    READY: float = 16.0
    FLOOR: float = 0.1  # a credited step's seconds stay above this share of its seconds without the wait
    arm: str | None = None
    short: tuple = (0.0, 0.0)      # decayed (wait s, lookups)
    long: tuple = (0.0, 0.0, 0.0)  # decayed (wait s, lookups, steps)
    fit: tuple = (0.0, 0.0)        # decayed (Σ excess × next step's excess, Σ excess²): `beta`

    def fold(self, arm: str, wait: float, lookups: int) -> None:
        """A step of the exploited arm `arm`."""
        if arm != self.arm:
            self.arm, self.short, self.long, self.fit = arm, (0.0, 0.0), (0.0, 0.0, 0.0), (0.0, 0.0)
        ks, kl = 0.5 ** (1.0 / self.SHORT), 0.5 ** (1.0 / self.LONG)
        r = self.ratios() if lookups > 0 else None
        if r is not None:  # how far the moment's excess before this step foretold this step's
            x, y = r[0] - r[1], wait / lookups - r[1]
            self.fit = (kl * self.fit[0] + x * y, kl * self.fit[1] + x * x)
        self.short = (ks * self.short[0] + wait, ks * self.short[1] + lookups)
        self.long = (kl * self.long[0] + wait, kl * self.long[1] + lookups, kl * self.long[2] + 1.0)

    def ratios(self) -> tuple[float, float] | None:
        """(recent, long-run) seconds per lookup of the exploited arm; None until `READY` steps are in."""
        if self.long[2] < self.READY or self.short[1] <= 0 or self.long[1] <= 0:
            return None
        return self.short[0] / self.short[1], self.long[0] / self.long[1]

    def credit(self, seconds: float, wait: float, lookups: int) -> float:
        """A trial step's seconds with its wait less `lookups` × the moment's excess wait per lookup over the long
        run's × `beta` (more wait where the moment runs hits). The credited wait may go below none: the excess
        averages 0, and clamping the wait at none charged a trial 3-18% more than an identical exploited arm where
        misses come in independent bursts (a simulation); only the step's seconds are kept above `FLOOR` × those
        without the wait."""
        r = self.ratios() if lookups > 0 else None
        if r is None:
            return seconds
        recent, long = r
        return max(self.FLOOR * (seconds - wait), seconds - self.beta() * lookups * (recent - long))

    def beta(self) -> float:
        """How far the moment's excess carries into the next step (the regression slope of a step's excess wait
        per lookup on the moment's before it, in [0, 1]): about 1 where misses come in runs (a request's, a
        topic's), about 0 where they come in independent bursts, and there a trial is credited what it waited
        (subtracting an excess that foretells nothing only adds its noise to the trial's rate)."""
        sxy, sxx = self.fit
        return min(1.0, max(0.0, sxy / sxx)) if sxx > 0 else 0.0


def _rate(steps) -> float:
    """Tokens/s over `steps` [(tokens, seconds, rows)]: a ratio of sums."""
    return sum(x[0] for x in steps) / sum(x[1] for x in steps)


def _se(steps) -> float:
    """Standard error of a rate measured over `steps` [(tokens, seconds, rows)]: the spread of the steps' rates over
    √steps (inf below 2)."""
    if len(steps) < 2:
        return math.inf
    xs = [x[0] / x[1] for x in steps]
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


@dataclass
class ArmRates:
    """Realized tokens/s per (arm, batch bucket): the measurements `measured.MeasuredArms` chooses by."""
    min_steps: int = 4       # steps an arm needs at a bucket before its rate counts (0: never explore) ...
    WIDE: int = 64           # ... half as many from this bucket on (`need`)
    WINDOW: int = 32         # the last steps an arm's rate is taken over (ratio of sums: tokens / seconds)
    DRIFT: float = 0.25
    FAR: float = 0.6         # on drift, arms measured below this share of the exploited arm's rate stay measured
    RECENT: int = 16         # drift: the exploited arm's last steps against the as many before them
    SETTLE: int = 8          # steps of the last 2·SETTLE in a bucket before it is explored
    MOMENTS: int = 3         # the exploited arm's blocks of `need` steps before their spread floors a rate's se
    win: dict = field(default_factory=dict)        # (arm, bucket) -> deque[(tokens, seconds, rows, step)]
    last: dict = field(default_factory=dict)       # (arm, bucket) -> step last measured
    calm: dict = field(default_factory=dict)       # (arm, bucket) -> its steps recorded since its last drift
    real: dict = field(default_factory=dict)       # arm -> [tokens emitted, tokens expected on pooled acceptance]
    trials: dict = field(default_factory=dict)     # (arm, bucket) -> trials completed (1, or 2 after a second opinion)
    prior: dict = field(default_factory=dict)      # (arm, bucket) -> its first trial's steps, while the second runs
    SHRINK: float = 256.0    # pseudo-tokens at calibration 1 in an arm's (`kappa`)
    REAL_MAX: float = 8192.0  # expected tokens after which an arm's calibration sums are halved
    stale: set = field(default_factory=set)        # (arm, bucket) flagged by drift
    current: dict = field(default_factory=dict)    # bucket -> the exploited arm
    prev: str | None = None                        # the last step's arm (a switch's first step is not measured)
    recent: deque = field(default_factory=deque)  # buckets of the last 2·SETTLE steps
    seen: dict = field(default_factory=dict)       # bucket -> steps recorded there
    drifts: int = 0                                # drifts detected
    second_trials: int = 0                         # second opinions completed (`_trial_done`)
    laps: Laps = field(default_factory=Laps)       # what a batch's ragged tail costs each arm (`laps`)
    moments: dict = field(default_factory=dict)    # bucket -> MissMoment (a step's wait is credited by it)

    def __post_init__(self):
        self.recent = deque(self.recent, maxlen=2 * self.SETTLE)

    def record(self, arm: str, B: int, tokens: float, seconds: float, step: int, expected: float | None = None,
               wait: float = 0.0, lookups: int = 0, choice: bool = True, young: bool = False) -> None:
        """One step of `arm` at batch B emitted `tokens` in `seconds` (its whole cycle as the decoder measured it);
        `expected`: what its drafts were worth on the drafter's pooled acceptance (a chain step; else `tokens`);
        `wait`: of its seconds, those it waited for expert loads, over `lookups` experts its forwards looked up
        (a trial's is credited less the moment's excess: module docstring). `choice` False: a plain step nothing
        else could have taken (every row at its last token): part of its batch's lap, no arm's measurement (the
        last steps of a batch's ragged tail measured plain alone at buckets 1-4, and the tails of batch 64 ran
        plain there while the fixed eagle-g2 drafted on). `young`: the rows were in their first tokens (`YOUNG`),
        which run slower on every arm (a request's experts are not cached yet): part of the lap and of the arm's
        calibration, not of its window, since no trial starts there (`MeasuredArms._explore`) and an exploited
        arm's window holding them read it below a trial measured after them."""
        b = bucket(B)
        self.recent.append(b)
        self.seen[b] = self.seen.get(b, 0) + 1
        if not choice:
            if tokens > 0 and seconds > 0:
                self.laps.step(arm, B, float(tokens), float(seconds))
            return
        switched, self.prev = self.prev is not None and self.prev != arm, arm
        if tokens <= 0 or seconds <= 0:
            return
        moment = self.moments.setdefault(b, MissMoment())
        if self.current.get(b) == arm:  # the exploited arm's steps stand as measured, and make the moment
            moment.fold(arm, float(wait), int(lookups))
        else:
            seconds = moment.credit(float(seconds), float(wait), int(lookups))
        if seconds <= 0:
            return
        credited = expected is not None and expected > 0 and b < self.WIDE  # (`credits`)
        e = float(expected) if credited else float(tokens)
        self.laps.step(arm, B, float(tokens), float(seconds), e)
        if credited:
            real = self.real.setdefault(arm, [0.0, 0.0])
            real[0], real[1] = real[0] + float(tokens), real[1] + e
            if real[1] > self.REAL_MAX:  # old text fades: halve both sums
                real[0], real[1] = real[0] / 2, real[1] / 2
        if switched or young:
            return
        key = (arm, b)
        w = self.win.setdefault(key, deque(maxlen=self.WINDOW))
        w.append((e, float(seconds), int(B), step))
        self.last[key] = step
        self.stale.discard(key)
        self.calm[key] = self.calm.get(key, 0) + 1
        if len(w) == self.need(b):
            self._trial_done(key, w)
        R = self.RECENT
        if self.current.get(key[1]) == arm and len(w) >= 2 * R and self.calm[key] >= R:
            steps = list(w)
            before, recent = steps[-2 * R:-R], steps[-R:]
            a, r = _rate(before), _rate(recent)
            if abs(r / a - 1.0) > self.DRIFT and abs(r - a) > 2.0 * math.hypot(_se(before), _se(recent)):
                # the workload moved: the others' rates are old news, for those within FAR of it (rated on pooled
                # acceptance, an arm far behind stays behind when the text moves: re-measuring self-g2 at 0.4x
                # after every drift spent the budget for nothing)
                # (not those measured since the move began: their readings are of the moved workload already)
                keep, moved = self.FAR * min(a, r) * self.credits(arm, key[1]), recent[0][3]
                self.stale |= {k for k, v in self.win.items() if k[1] == key[1] and k[0] != arm and v
                               and self.rate_of(k) >= keep and self.last.get(k, -1) < moved}
                self.calm[key] = 0
                for _ in range(len(w) - R):  # its own steps before the move are old news too
                    w.popleft()
                self.drifts += 1  # (a reused call ends: the next step plans, and may re-measure, `Coasting`)

    def _trial_done(self, key, w) -> None:
        """The arm's window just reached `need` steps: a trial completed. After a second opinion (`_target`), the
        better of its two trials stands (a trial is a few steps: one that met two stalls rated eagle-g2 at 154 tok/s,
        0.7x its fixed engine, and ruled it out; a rate read too high is corrected by the steps the arm then runs
        exploited, one read too low never is). Not after other re-measures: each more reading kept at its best is
        one more lottery ticket for the arm, and a 4-step reading's luck is what makes an arm the best of many
        (with the better of two kept after every re-measure, and arms displaced by another drafter's re-measured,
        auto ran demo batch 1, fp32, at 0.67-0.81x the fixed eagle-g2 over 4 rounds, about the AR baseline's rate)."""
        first = self.prior.pop(key, None)
        self.trials[key] = self.trials.get(key, 0) + 1
        self.second_trials += first is not None
        if first is not None and _rate(first) > _rate(w):
            w.clear()
            w.extend(first)

    def interrupt(self) -> None:
        """A step of no arm (forced or scheduled): the next arm's first step is a switch, and its lap is no arm's."""
        self.prev = "-"
        self.laps.interrupt()

    def rate_of(self, key, rows: int = 0) -> float:
        """The arm's pooled-acceptance tokens over seconds in its window (`_steps`) × its calibration (`credits`)."""
        return _rate(self._steps(key, rows)) * self.credits(*key)

    def _steps(self, key, rows: int = 0):
        """The arm's window at a bucket; given `rows`, only its steps of at least that many rows while `need` of
        them are left (`_rows`)."""
        w = self.win.get(key, ())
        if rows > 1:
            some = [x for x in w if x[2] >= rows]
            if len(some) >= max(1, self.need(key[1])):
                return some
        return w

    def _rows(self, names, b: int) -> int:
        """The rows arms are compared at, at bucket b: the most any measured arm's window has at its fewest. A
        bucket spans a batch's full steps and its first rows' ends (64 rows, then 60, 47...): a trial bursts from a
        fresh plan, at a batch's start, while the exploited arm's window spans its whole life, and a step of 64 rows
        emits more tokens a second than one of 48 (eagle-g4's trial steps rated it 13% above eagle-g2 at batch 64,
        while over whole batches it ran 9% slower)."""
        k = max(1, self.need(b))
        return max((min(x[2] for x in w) for n in names if len(w := self.win.get((n, b), ())) >= k), default=0)

    def kappa(self, arm: str) -> float:
        """Tokens the arm emitted per token its drafts were worth on pooled acceptance, over its steps below `WIDE`
        rows (its stop rule or draft length beats or trails the pooled estimate), shrunk toward 1 (the pooled
        estimate as it is) by `SHRINK` pseudo-tokens: an arm seen on few steps does not take its own text's luck.
        Not toward the drafter's other lengths: the bias can be the length's (in three traces at batch 4 eagle-g2
        emitted 0.97-1.11x its pooled tokens, eagle-g4 0.91-0.94x; pooled together, eagle-g4 read faster than it
        ran and held the batch while the fixed eagle-g2 ran 10-14% faster)."""
        t, e = self.real.get(arm, (0.0, 0.0))
        return (t + self.SHRINK) / (e + self.SHRINK)

    def credits(self, arm: str, b: int) -> float:
        """Realized tokens per credited token of `arm`'s steps at bucket b: its calibration (`kappa`) below `WIDE`
        rows; 1 from `WIDE` on, where a step is credited with what it emitted. A step of that many rows averages
        its rows' text (what the credit is for), while the credit's own bias does not average out: at batch 64 on
        the demo model the fixed eagle-g4's full steps emitted 4% more tokens a second than eagle-g2's and its whole
        batches ran 3% slower (benchmarks/results/lap_tails_demo_fp32.json), while eagle-g4's steps were credited
        far more than 4% above eagle-g2's, and `auto` held eagle-g4."""
        return self.kappa(arm) if b < self.WIDE else 1.0

    def rate(self, arm: str, B: int) -> float | None:
        """The arm's measured tokens/s at B's bucket (None until `need` steps are measured there)."""
        return self.score(arm, bucket(B))

    def score(self, arm: str, b: int, rows: int = 0) -> float | None:
        """The arm's credited tokens/s at bucket b (over its steps of at least `rows` rows: `_steps`) in realized
        whole-batch tokens/s (`scale`)."""
        if self.n(arm, b) < max(1, self.need(b)):
            return None
        return _rate(self._steps((arm, b), rows)) * self.scale(arm, b)

    def scale(self, arm: str, b: int) -> float:
        """Realized whole-batch tokens per credited token for `arm` at bucket b: its calibration (`credits`) × what a
        batch's ragged tail leaves (`Laps.of`), or, once it has run whole batches there, what those realized
        (`Laps.priced`)."""
        return self.laps.priced(arm, b, self.credits(arm, b))

    def need(self, b: int) -> int:
        """Steps an arm needs at bucket b before its rate counts: `min_steps`, halved from `WIDE` rows on (a step's
        rate averages its rows' acceptance, so a 64-row step is several times less noisy than a 1-row one, and a
        batch that large takes few steps per request: 5-step bursts left one trial per bucket in 300 steps)."""
        return self.min_steps if b < self.WIDE else (self.min_steps + 1) // 2

    def se_of(self, key, rows: int = 0) -> float:
        """Standard error of the arm's rate at a bucket (`_se` of its window, × `scale`; `_steps`), at least what
        its window's moments leave (`moment_cv`): a trial's `need` steps run back to back, at one moment of the text
        and the cache, and their spread is not the spread between moments. The arm taken is the best of several
        such readings, so mostly the luckiest: at demo batch 4 (fp32) the trial that made plain the exploited arm read
        276 tok/s and plain then ran at 184-194, eagle-g4's read 388 and it then ran at 234-296, and the one-moment
        spread made those leads look clear (auto ran 0.87-0.94x the best fixed engine at 3 of 4 batch sizes). Here
        a window of n steps counts as n / `need` independent moments."""
        steps = self._steps(key, rows)
        se, cv = _se(steps), self.moment_cv(key[1])
        if cv and steps:
            se = max(se, cv * _rate(steps) * math.sqrt(max(1, self.need(key[1])) / len(steps)))
        return se * self.scale(*key)

    def moment_cv(self, b: int) -> float | None:
        """The spread between moments at bucket b: the relative standard deviation of the rates of the exploited
        arm's consecutive blocks of `need` steps (what one trial's reading of an arm would spread by, were it that
        arm), over its window; None until it has `MOMENTS` whole blocks."""
        w, k = list(self.win.get((self.current.get(b), b), ())), max(1, self.need(b))
        blocks = [w[i - k:i] for i in range(len(w), k - 1, -k)]
        if len(blocks) < self.MOMENTS:
            return None
        rs = [_rate(x) for x in blocks]
        m = sum(rs) / len(rs)
        return math.sqrt(sum((r - m) ** 2 for r in rs) / (len(rs) - 1)) / m if m > 0 else None

    def since(self, arm: str, b: int) -> int | None:
        """The step the arm's window at bucket b starts at (None: empty)."""
        w = self.win.get((arm, b))
        return w[0][3] if w else None

    def n(self, arm: str, b: int) -> int:
        return len(self.win.get((arm, b), ()))

    def state(self) -> dict:
        """What `warm` reads back: each arm's measured (tokens, seconds) per bucket, summed over its window, and its
        step count; its calibration sums; its laps (`Laps.state`)."""
        out = {f"{a}@{b}": [sum(x[0] for x in w), sum(x[1] for x in w), len(w)] for (a, b), w in self.win.items() if w}
        return out | {f"{a}@real": list(v) for a, v in self.real.items()} | {"laps": self.laps.state()}

    def warm(self, state: dict) -> None:
        """Start from remembered rates as `need` measured steps at step 0 (stale after `STALE` steps; this run's own
        steps push them out of the window)."""
        for k, v in state.items():
            if k == "laps":
                if isinstance(v, dict):
                    self.laps.warm(v)
                continue
            if k.endswith("@real"):
                try:
                    self.real[k[:-5]] = [float(v[0]), float(v[1])]
                except (TypeError, ValueError, IndexError):
                    pass
                continue
            try:
                arm, b = k.rsplit("@", 1)
                b, tokens, seconds, n = int(b), float(v[0]), float(v[1]), int(v[2])
            except (TypeError, ValueError, IndexError):
                continue
            k2 = max(1, self.need(b))
            if tokens <= 0 or seconds <= 0 or n < k2:
                continue
            self.win[(arm, b)] = deque([(tokens / n, seconds / n, b, 0)] * k2, maxlen=self.WINDOW)
            self.last[(arm, b)] = 0
