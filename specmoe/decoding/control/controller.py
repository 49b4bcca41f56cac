"""`decoding="auto"`'s controller: per step, a plain step or speculation, and per sequence which drafter
(self, eagle, ngram) and how many tokens it drafts (0..γ_max), chosen to maximise predicted tokens per second

    rate = (B + Σ_b Σ_{j<γ_b} P_{d_b,b,j}) / (Σ_d D_d(rows of d per depth) + V(B + Σ_b γ_b) + setup)

(the chain case of cost-aware draft selection) where D_d (each drafter's draft phase), V (the verification
forward, with the expected expert union and misses, its non-expert model over the rows padded to the longest) and the setup of the self draft's set come from the
calibrated `CostModel`, and P_{d,b,j}, the probability that sequence b's j-th draft by drafter d is accepted
(all before it accepted), from acceptance calibrated online per drafter: per draft position
(`Acceptance.position`), scaled by the sequence's own recent acceptance with that drafter and per position by
what recent plans' rows accepted against the P they were planned on (`Acceptance.calibration`). A lookup drafter
(ngram) says before the step how long its proposal for each sequence is (`Drafter.available`); rows without
one cannot use it. Candidate plans (`candidates.py`): for each threshold θ on P (a row drafts while P ≥ θ),
capped at each common depth (the verification pads rows to the longest), every drafter alone, and each model
drafter mixed with the lookup drafter (a row takes whichever expects more
accepted tokens), plus plain. The last step's arm (plain or a drafter mix) is left only for one predicted
`switch_margin` faster (hysteresis: near a tie, flipping follows prediction noise and pays catch-ups) once a
speculative step has been measured at the batch size or one next to it (before that each drafter predicted within
0.8× of the best is tried there once); every `explore_every` steps a
drafter not used for that long is tried when its best plan is predicted within 0.8× of the best, so its
acceptance estimate follows the workload.

While drafting, each greedy sequence's running P is updated from the draft's own confidence (its softmax
probability of the drafted token, mapped to an acceptance probability calibrated online by confidence
bin (log-spaced), per drafter), and the sequence stops drafting once the running P falls below the plan's θ or
the calibrated probability of the token just drafted below `p_min`.
"""
from __future__ import annotations

import math
import time

import numpy as np
import torch

from specmoe.decoding.control.candidates import candidates
from specmoe.decoding.control.coasting import Coasting
from specmoe.decoding.control.costmodel import CostModel, bucket
from specmoe.decoding.control.feedback import StepFeedback
from specmoe.decoding.control.learning import Acceptance, Realized
from specmoe.decoding.control.plan import Plan

PRIOR = {"self": 0.6, "eagle": 0.7, "ngram": 0.6}  # acceptance priors (weight 2) before anything is measured


class Controller(Coasting, StepFeedback):
    """Chooses each step (module docstring). Every choice is an *arm*: a plain step, or a speculative plan named by
    its drafter (mix). Its rate is the cost model's (refined per component, `CostModel.refine`) over unbiased
    acceptance estimates, divided by what that arm's steps realized against such predictions
    (`Realized.slowdown`, seconds per emitted token). Upper-confidence acceptance estimates (UCB: the bonus shrinks
    with the rows a drafter has drafted and grows slowly with the steps taken, so an arm that lost on a few
    unlucky rows is tried again) decide only which drafters get a trial: a drafter whose upper-confidence rate is
    within `EXPLORE_WITHIN` of the best choice is first tried on `MIN_TRIALS` rows. Reusing a call
    (`coasting.Coasting`) and folding measured steps back in (`feedback.StepFeedback`) are mixed in. `force`
    ("plain" / "spec", None = choose) and `schedule` (a callable step index -> "plain" / "spec") override the
    choice, for tests and benchmarks; forced speculation drafts every sequence's full γ with the first drafter
    (what decoding="specmoe" does) but for the p_min floor (0 turns it off)."""

    SAVE_EVERY = 32  # speculative steps between writes of the memory
    MIN_TRIALS = 4  # rows a drafter first drafts when predicted within EXPLORE_WITHIN of the best choice (0: no
    # first trials, at all or per batch size)
    EXPLORE_WITHIN = 0.8
    OPTIMISM = 1.0  # upper-confidence acceptance estimates while a drafter is seen on few rows

    def __init__(self, cost: CostModel, gamma_max: int, drafters: tuple[str, ...] = ("self",), *,
                 p_min: float = 0.05, explore_every: int = 64):
        self.cost, self.g = cost, gamma_max
        self.names = list(drafters)
        self.accs = {n: Acceptance(gamma_max, prior=PRIOR.get(n, 0.6)) for n in self.names}
        self.p_min, self.explore_every = p_min, explore_every
        self.optimism = self.OPTIMISM
        self.force: str | None = None
        self.schedule = None
        self.steps = self.stops = 0
        self.since_spec = 0
        self.last_used = dict.fromkeys(self.names, 0)
        self.coasting = (frozenset(), 0)  # (sequence ids, steps left) of a plain call reused without planning
        self.coast_steps, self.coast_below = 3, 0.8
        self.coast_max = 16  # the most steps a call is reused for while planning is dear
        # (sequence ids, plan, steps left) of a clear speculative call reused without planning (`coast_spec`)
        self.spec_coasting: tuple | None = None
        self.coast_above = 1.25
        # any call is reused so when planning costs more than this share of the step it plans (the controller's
        # own time is what a step of a few ms loses to it)
        self.coast_share = 0.03
        self.plan_s: float | None = None  # EMA of a fresh plan's seconds
        self.outside: dict[int, float] = {}  # batch bucket -> EMA of a step's cycle seconds the model does not price
        self.learn_s: float | None = None  # EMA of `_learn_time`'s seconds
        self.learn_share = 0.01  # the share of a step the time model's learning may cost on reused-call steps
        self.learn_skip = 0  # reused-call steps left before the next one whose time is learned
        # hysteresis: leave the last step's arm (plain, or a drafter mix) only for an arm predicted this much
        # faster; near a tie, flipping between arms pays each one's catch-up and follows prediction noise
        self.switch_margin = 1.1
        self.last_arm = "plain"  # a new controller starts plain: speculation first has to win by the margin
        self.choices = {"plain": 0, "spec": 0}
        self.reasons: dict[str, int] = {}
        self.rows_by_drafter = dict.fromkeys(self.names, 0)
        self.decoder = None
        self.realized = Realized()  # per arm and batch bucket: measured / predicted step seconds
        self.resident = self.spec_resident = None  # [L, E] the last plan's resident experts without / with the
        # self draft's set
        self.catchup: dict[str, np.ndarray] = {}  # the last plan's catch-up entries per drafter and row
        self.controller_s = 0.0
        self.conf: dict[int, list[float]] = {}
        # (kind, B, predicted s, raw predicted s, measured s, predicted plain tok/s, best speculative tok/s)
        self.predictions: list[tuple] = []
        self.arm_rates: dict[str, float] = {}  # the last planned step's predicted tokens/s per arm (corrected)
        self.memory = None  # a ControllerMemory (`remember`)
        self.warmed: list[str] = []  # drafters whose estimates started from the memory
        self.learned = 0  # speculative steps folded in

    @property
    def acc(self) -> Acceptance:
        """The first drafter's acceptance (a single-drafter controller's)."""
        return self.accs[self.names[0]]

    @acc.setter
    def acc(self, value: Acceptance) -> None:
        self.accs[self.names[0]] = value

    def use(self, drafters: list[str]) -> None:
        """Plan over these drafters (a decoder's, in its order: the first is forced speculation's)."""
        for n in drafters:
            if n not in self.accs:
                self.accs[n] = Acceptance(self.g, prior=PRIOR.get(n, 0.6))
                self.rows_by_drafter[n] = 0
            self.last_used.setdefault(n, 0)
        self.names = list(drafters)

    def remember(self, memory) -> None:
        """Start each drafter's acceptance and the step-time corrections from `memory` (a `ControllerMemory`)
        and write them back every `SAVE_EVERY` speculative steps."""
        self.memory = memory
        self.warmed = memory.warm(self.accs)
        self.cost.warm(memory.section("cost"))
        self.realized.warm(memory.section("realized"))

    def admit(self, seqs) -> None:
        """Sequences new to the decoder (ids are reused once a sequence finishes): nothing measured on an earlier
        holder of the id is theirs. A call being reused goes on for them (the workload's drafter and length, a
        better start than none: at batch 1 every request would otherwise plan its first steps afresh)."""
        ids = [s.seq_id for s in seqs]
        for acc in self.accs.values():
            acc.forget(ids)

    # ------------------------------------------------------------ the choice, over arrays
    def note_outside(self, B: int, seconds: float) -> None:
        """Fold in one step's cycle seconds outside what the model prices (`SpeculativeDecoder.step`): the plan,
        the controller's learning, the engine's loop between steps; an EMA per batch bucket."""
        if seconds >= 0:
            b, old = bucket(B), self.outside.get(bucket(B))
            self.outside[b] = seconds if old is None else 0.9 * old + 0.1 * seconds

    def outside_s(self, B: int) -> float:
        """Seconds a step at batch B spends outside what the model prices (nearest measured bucket; 0 before)."""
        if not self.outside:
            return 0.0
        b = bucket(B)
        return self.outside[b if b in self.outside else min(self.outside, key=lambda k: abs(math.log2(k / b)))]

    def _probs(self, name: str, seq_ids: list[int], avail: np.ndarray, optimism: float,
               calibrated: bool = True) -> np.ndarray:
        """[B, G] P_{b,j}: position estimate × the sequence's factor (× the plans' calibration k_j), non-increasing
        in j, 0 past what the row may draft."""
        acc = self.accs[name]
        P = acc.position(optimism)[None, :] * acc.seq_factor(seq_ids)[:, None]  # [B, G]
        if calibrated:
            P = P * acc.calibration()[None, :]
        P = np.minimum.accumulate(np.minimum(P, 1.0), axis=1)
        return np.where(np.arange(self.g)[None, :] < np.asarray(avail)[:, None], P, 0.0)

    def draft_rows(self, mine: np.ndarray, Gm: np.ndarray, catchup: np.ndarray | None) -> np.ndarray:
        """[C, G] rows each draft forward of a drafter computes, per candidate: the rows `mine` [C, B] still drafting
        at depth j; the first forward, padded to its longest catch-up (catchup [B] entries per row), runs
        rows · max entries."""
        G = max(int(Gm.max()), 1)
        rows = ((Gm[:, :, None] > np.arange(G)[None, None, :]) & mine[:, :, None]).sum(1)
        if catchup is not None:
            longest = np.where(mine, catchup[None, :], 0).max(1)
            rows[:, 0] *= np.maximum(longest, 1)
        return rows

    def _costs(self, W: np.ndarray, Gm: np.ndarray, names: list[str], resident, spec_resident,
               setup: dict[str, float], catchup: dict[str, np.ndarray]
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per candidate c (W [C, B]: index into names of each row's drafter, Gm [C, B] its draft length):
        raw draft s, raw verify s, refined total s and expected misses, each [C]."""
        cm = self.cost
        C, B = Gm.shape
        d_raw, d_ref, s_setup = np.zeros(C), np.zeros(C), np.zeros(C)
        uses_self = np.zeros(C, bool)
        for i, n in enumerate(names):
            mine = (W == i) & (Gm > 0)  # [C, B]
            if not mine.any():
                continue
            t = cm.drafter_time(n, self.draft_rows(mine, Gm, catchup.get(n))).sum(1)
            d_raw += t
            d_ref += t * cm.ratio(f"draft:{n}", B)
            used = mine.any(1)
            s_setup += used * setup.get(n, 0.0)
            if n == "self":
                uses_self |= used
        n_tok = B + Gm.sum(1)
        eff = cm.effective(B, Gm.sum(1))
        u0, m0 = cm.expected_union(eff, resident, "spec")
        u1, m1 = cm.expected_union(eff, spec_resident, "spec")
        union, miss = np.where(uses_self[:, None], u1, u0), np.where(uses_self[:, None], m1, m0)
        padded = B * (1 + Gm.max(1))
        v = cm.forward_time(n_tok, union, miss, padded)
        part, memo = cm.fwd(B), {}
        fwd = np.array([memo[b] if (b := bucket(int(k))) in memo else memo.setdefault(b, cm.ratio(part, int(k)))
                        for k in n_tok])
        return d_raw, v, d_ref + v * fwd + s_setup + cm.overhead("spec", B, padded), miss.sum(1)

    def choose(self, seq_ids: list[int], avail: dict[str, list[int]], resident: np.ndarray,
               spec_resident: np.ndarray, setup: dict[str, float] | None = None,
               catchup: dict[str, list[int]] | None = None) -> Plan:
        """`avail[d][b]`: the most drafter d may draft for sequence b (its limit; a lookup drafter: its
        proposal's length); `resident` / `spec_resident` [L, E]: resident experts for a step without / with the
        self draft's set; `setup[d]`: seconds drafter d would first spend on setup (the self draft's set);
        `catchup[d][b]`: entries drafter d's first forward would run for sequence b (`Drafter.catchup`)."""
        setup = setup or {}
        catchup = {n: np.asarray(v) for n, v in (catchup or {}).items()}
        names = [n for n in self.names if n in avail]
        B = len(seq_ids)
        cm = self.cost
        t_plain_raw, t_plain = cm.plain_parts(B, resident)
        t_plain += cm.overhead("plain", B)
        plain_raw = B / t_plain
        ext = self.outside_s(B)  # every step's cost outside what the model prices, whichever the arm
        plain_rate = B / (t_plain * self.realized.slowdown("plain", B, self.steps) + ext)
        opt = self.optimism * np.sqrt(np.log(2.0 + self.steps))  # UCB: an arm left unused grows more optimistic
        # draft lengths come from unbiased acceptance (optimism there would draft every row deeper than pays, on
        # every step); the upper-confidence estimate only scores the arms against each other (exploration)
        P = {n: self._probs(n, seq_ids, avail[n], 0.0) for n in names}
        Pu = {n: self._probs(n, seq_ids, avail[n], opt) for n in names}
        cand = candidates(names, P, Pu, avail, B, self.g)
        W, Gm, gain, gain_ucb, theta, tags, idx = (cand.W, cand.Gm, cand.gain, cand.gain_ucb, cand.theta, cand.tags,
                                                   cand.idx)
        ar = np.arange(self.g)
        want, reason = None, "model"
        if self.schedule is not None:
            want, reason = self.schedule(self.steps), "schedule"
        elif self.force is not None:
            want, reason = self.force, "forced"
        if want == "spec" and names:  # every sequence its full γ with the first drafter
            full = np.asarray(avail[names[0]])
            if full.sum():
                W, Gm = np.zeros((1, B), int), full[None]
                gain = np.array([float((P[names[0]] * (ar[None, :] < full[:, None])).sum())])
                gain_ucb = np.array([float((Pu[names[0]] * (ar[None, :] < full[:, None])).sum())])
                theta, tags, idx = np.array([np.nan]), [names[0]], np.array([0])
        rows = [(W[c], Gm[c], float(gain[c]), None if np.isnan(theta[c]) else float(theta[c]), tags[c],
                 float(gain_ucb[c])) for c in idx]
        best = None
        by_drafter: dict[str, tuple] = {}
        if rows:
            W = np.stack([r[0] for r in rows])
            Gm = np.stack([r[1] for r in rows])
            gains = np.array([r[2] for r in rows])
            d_raw, v_raw, t, miss = self._costs(W, Gm, names, resident, spec_resident, setup, catchup)
            raw = (B + gains) / t
            tag_arr = np.array([r[4] for r in rows])
            ucb = np.array([r[5] for r in rows])
            for tag in dict.fromkeys(tag_arr.tolist()):  # the best candidate of each drafter (mix), unbiased
                slow = self.realized.slowdown(tag, B, self.steps)
                mine = np.flatnonzero(tag_arr == tag)
                c = int(mine[np.argmax((B + gains[mine]) / (t[mine] * slow + ext))])
                who, gam, _, th, _, _ = rows[c]
                # the arm is scored by its unbiased rate, corrected by what its steps realized; the
                # upper-confidence one (last) only decides which arms are worth a trial (exploration)
                step = float(t[c]) * slow + ext
                by_drafter[tag] = (float(B + gains[c]) / step, who, gam, th, tag, float(d_raw[c]), float(v_raw[c]),
                                   float(t[c]) * slow, float(miss[c]), float(raw[c]), float(B + ucb[c]) / step)
            best = max(by_drafter.values(), key=lambda row: row[0])
        spec_rate = best[0] if best is not None else 0.0
        self.arm_rates = {"plain": plain_rate, **{tag: row[0] for tag, row in by_drafter.items()}}
        if want is None:
            want = "spec" if best is not None and spec_rate > plain_rate else "plain"
            stay = by_drafter.get(self.last_arm) if self.last_arm != "plain" else None
            # until a speculative step is measured at this batch size, plain has nothing measured to defend
            margin = self.switch_margin if any(self.realized.measured(t, B) for t in by_drafter) else 1.0
            if self.last_arm == "plain" and want == "spec" and spec_rate < margin * plain_rate:
                want = "plain"
            elif stay is not None and max(spec_rate, plain_rate) < self.switch_margin * stay[0]:
                best, want = stay, "spec"
            top = max(spec_rate, plain_rate)
            # a drafter's acceptance is its prior until it drafts, and its step time a model until measured at this
            # batch size: try it on a few rows first, and once per batch size, when predicted close to the best
            untried = [tag for tag in by_drafter if "+" not in tag and by_drafter[tag][-1] >= self.EXPLORE_WITHIN * top
                       and (self.accs[tag].drafted[0] < self.MIN_TRIALS
                            or (self.MIN_TRIALS and not self.realized.measured_near(tag, B)))]
            if untried:
                best, want, reason = by_drafter[untried[0]], "spec", "explore"
            elif best is not None and self.steps and self.steps % self.explore_every == 0:
                # a drafter not used for a while: try its best plan when it is predicted close to the best
                stale = [tag for tag in by_drafter if "+" not in tag
                         and self.steps - self.last_used.get(tag, 0) >= self.explore_every
                         and by_drafter[tag][-1] >= self.EXPLORE_WITHIN * max(spec_rate, plain_rate)]
                if stale:
                    best = by_drafter[min(stale, key=lambda tag: self.last_used.get(tag, 0))]
                    want, reason = "spec", "explore"
            if (want == "plain" and best is not None and self.since_spec >= self.explore_every
                    and spec_rate >= 0.9 * plain_rate):
                want, reason = "spec", "explore"  # keep the acceptance estimates alive near the break-even
            elif (want == "spec" and reason == "model" and plain_rate >= self.EXPLORE_WITHIN * spec_rate
                  and self.explore_every <= self.realized.age("plain", B, self.steps) < math.inf):
                # plain steps measured at this batch size long ago while speculating near a tie: one plain step
                # re-measures what speculation is compared against
                want, reason = "plain", "explore"
        self.steps += 1
        self.choices[want] += 1
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        spec_g = best[2].astype(int).tolist() if best is not None else [0] * B
        spec_d = [names[i] for i in best[1]] if best is not None else [None] * B
        self.spec_coasting = None
        if reason == "model":
            self.last_arm = "plain" if want == "plain" or best is None else best[4]
        if want == "plain" or best is None:
            self.since_spec += 1
            # a clear call, or dear planning: the next steps reuse it without planning (not when nothing could be
            # drafted this step: a sequence at its last token, a lookup without a match)
            if reason == "forced" or (reason == "model" and best is not None
                                      and (spec_rate < self.coast_below * plain_rate or self._dear(B / plain_rate))):
                self.coasting = (frozenset(seq_ids), self._coast_len(B / plain_rate))
            _, miss = cm.expected_union(np.array([B]), resident, "plain")
            return Plan("plain", None, 1.0, B / plain_rate, t_plain_raw, float(miss.sum()), plain_rate, spec_rate, reason,
                        spec_g, None, spec_d, "plain", plain_raw)
        rate, who, gam, th, tag, d_raw, v_raw, t, miss, raw_rate, _ = best
        self.since_spec = 0
        theta = 0.0 if reason in ("forced", "schedule") or th is None else float(th)
        drafter_of = [names[i] if g else None for i, g in zip(who, gam)]
        probs = np.zeros((B, self.g))
        for n in set(d for d in drafter_of if d):
            self.last_used[n] = self.steps
            rows = [b for b, d in enumerate(drafter_of) if d == n]
            probs[rows] = self._probs(n, [seq_ids[b] for b in rows], np.full(len(rows), self.g), 0.0, False)
        plan = Plan("spec", gam.astype(int).tolist(), theta, t, d_raw + v_raw, miss, plain_rate, rate, reason,
                    spec_g, drafter_of, spec_d, tag, raw_rate, probs)
        if reason == "model" and (rate >= self.coast_above * plain_rate or self._dear(t)):  # the next steps reuse it
            self.spec_coasting = (tuple(seq_ids), plan, self._coast_len(t))
        return plan

    def plan(self, seq_ids: list[int], limits: list[int], resident: np.ndarray, spec_resident: np.ndarray,
             setup_s: float = 0.0) -> Plan:
        """`choose` for the first drafter alone (every sequence may draft limits[b]); `specmoe plan`'s view."""
        return self.choose(seq_ids, {self.names[0]: limits}, resident, spec_resident, {self.names[0]: setup_s})

    # ------------------------------------------------------------ inside a step
    def attach(self, decoder) -> None:
        """The decoder this controller plans for (its drafters, runner and store)."""
        self.decoder = decoder
        self.use(list(decoder.drafters))
        runner = decoder.runner
        if self.cost.routing.observe not in runner.observers:
            runner.observers.append(self.cost.routing.observe)
        # a draft set pinned by an earlier run stays pinned in the cache; auto's plain steps need the slots
        for layer in self.cost.routing.layers:
            runner.provider.pin(layer, [])

    def plan_step(self, seqs, limits: list[int]):
        """The StepPlan of this step (the decoder's `plan`)."""
        from specmoe.decoding.strategies.speculative import StepPlan
        t0 = time.perf_counter()
        B = len(seqs)
        try:
            if self.coast([s.seq_id for s in seqs]):
                return StepPlan([None] * B, [0] * B, None)
            plan = self.coast_spec(seqs, limits)
            if plan is None:
                t1 = time.perf_counter()
                plan = self._plan_fresh(seqs, limits)
                dt = time.perf_counter() - t1
                self.plan_s = dt if self.plan_s is None else 0.8 * self.plan_s + 0.2 * dt
            if plan.kind == "plain":
                return StepPlan([None] * B, [0] * B, plan)
            self.conf = {}
            for n in plan.drafter_of:
                if n:
                    self.rows_by_drafter[n] += 1
            return StepPlan(plan.drafter_of, plan.gammas, plan)
        finally:
            self.controller_s += time.perf_counter() - t0

    def _plan_fresh(self, seqs, limits: list[int]) -> Plan:
        """`choose` over what is resident now (without / with the self draft's set) and what each drafter has."""
        dec = self.decoder
        cm = self.cost
        cm.routing.flush()
        store = dec.runner.provider
        L = len(cm.routing.layers)
        res = np.zeros((L, cm.c.num_experts), dtype=bool)
        for i, layer in enumerate(cm.routing.layers):
            res[i, list(store.resident(layer))] = True
        spec_res, setup = res, {}
        sd = dec.drafters.get("self")
        if sd is not None:
            ex = sd.experts
            if ex.ready:
                spec_res = res.copy()
                for i, layer in enumerate(cm.routing.layers):
                    spec_res[i, ex.ids[layer]] = True
            else:
                spec_res = res | cm.routing.hottest(ex.n)
            if sd.needs_setup:  # the draft set's experts not resident now load first
                setup["self"] = float((spec_res & ~res).sum()) * cm.c.read_s + cm.c.read_latency_s * L
        self.resident, self.spec_resident = res, spec_res
        avail = {n: d.available(seqs, limits) for n, d in dec.drafters.items()}
        self.catchup = {n: np.asarray(d.catchup(seqs)) for n, d in dec.drafters.items()}
        return self.choose([s.seq_id for s in seqs], avail, res, spec_res, setup, self.catchup)

    def stopper(self, splan, name: str, rows: list[int], seqs, gammas: list[int]):
        """The draft hook of drafter `name` over its rows (batch rows `rows`, local gammas): records each greedy
        row's confidence and stops it once its running acceptance probability falls below the plan's θ or its
        calibrated acceptance probability below p_min."""
        plan = splan.decision
        if plan is None:
            return None
        acc = self.accs[name]
        run = np.ones(len(seqs))
        greedy = [s.params.greedy for s in seqs]
        theta = plan.theta if plan.reason not in ("forced", "schedule") else 0.0  # forced: the p_min floor only
        conf = {b: self.conf.setdefault(b, []) for b in rows}

        def hook(j: int, local: list[int], logits: torch.Tensor) -> None:
            c = torch.softmax(logits.float(), dim=-1).amax(-1).tolist()  # the draft's own confidence, one host read
            here = acc.by_confidence(np.asarray(c))  # calibrated: P(accepted | all before accepted)
            run[local] *= here
            for i, b in enumerate(local):
                conf[rows[b]].append(c[i])
                if greedy[b] and gammas[b] > j + 1 and (here[i] < self.p_min or run[b] < theta):
                    gammas[b] = j + 1
                    self.stops += 1
        return hook

    def stats(self) -> dict:
        st = {"controller_steps": dict(self.choices), "controller_reasons": dict(self.reasons),
              "controller_draft_stops": self.stops, "controller_p_min": self.p_min,
              "controller_rows_by_drafter": dict(self.rows_by_drafter), "controller_s": self.controller_s,
              "acceptance_warmed_from_memory": list(self.warmed),
              "step_predictions": [list(p) for p in self.predictions],
              **self.acc.stats(), **self.cost.stats()}
        st["acceptance_calibrated_by_drafter"] = {n: a.position().tolist() for n, a in self.accs.items()}
        st["acceptance_plan_calibration_by_drafter"] = {n: a.calibration().tolist() for n, a in self.accs.items()}
        st["arm_slowdown"] = self.realized.stats()  # measured / predicted step seconds per arm@bucket
        st["controller_arm_rates"] = {k: round(v, 2) for k, v in self.arm_rates.items()}
        st["step_outside_s"] = {str(b): v for b, v in sorted(self.outside.items())}  # per batch bucket
        return st
