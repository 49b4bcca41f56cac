"""`decoding="auto"`'s controller: per step, a plain step or speculation, and per sequence which drafter
(self, eagle, ngram) and how many tokens it drafts (0..γ_max).

Which *arm* a step takes (plain, or a drafter / drafter mix) is decided by measurement: each arm's realized tokens
per second in this process at this batch bucket (`measured.MeasuredArms`, successive elimination with exploration
bounded to a small share of the steps, re-exploring on drift and at batch buckets not measured yet). Within an
arm, the per-row draft lengths are priced by the predicted rate

    rate = (B + Σ_b Σ_{j<γ_b} P_{d_b,b,j}) / (Σ_d D_d(rows of d per depth) + V(B + Σ_b γ_b) + setup)

(the chain case of cost-aware draft selection) where D_d (each drafter's draft phase), V (the verification
forward, with the expected expert union and misses, its non-expert model over the rows padded to the longest)
and the setup of the self draft's set come from the calibrated `CostModel`, and P_{d,b,j}, the probability that
sequence b's j-th draft by drafter d is accepted (all before it accepted), from acceptance calibrated online per
drafter: per draft position (`Acceptance.position`, the product of the chain's node conditionals in the node
table the tree selection prices with too), scaled by the sequence's own recent acceptance with that
drafter and per position by what recent plans' rows accepted against the P they were planned on
(`Acceptance.calibration`). A lookup drafter (ngram) says before the step how long its proposal for each sequence
is (`Drafter.available`); rows without one cannot use it. Candidate plans (`candidates.py`): for each threshold θ
on P (a row drafts while P ≥ θ), capped at each common depth (the verification pads rows to the longest), every
drafter alone, and each model drafter mixed with the lookup drafter (a row takes whichever expects more accepted
tokens). The predicted rates also seed the order unmeasured arms are tried in, prune arms predicted far behind,
and decide while nothing is measured; they never override a measured comparison.

While drafting, each greedy sequence's running P is updated from the draft's own confidence (its softmax
probability of the drafted token, mapped to an acceptance probability calibrated online by confidence bin
(log-spaced), per drafter), and it stops once the running P falls below θ or the token's below `p_min`.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from specmoe.decoding.control.candidates import is_uniform, uniform_parts
from specmoe.decoding.control.coasting import Coasting
from specmoe.decoding.control.costmodel import CostModel
from specmoe.decoding.control.feedback import StepFeedback
from specmoe.decoding.control.laps import spread
from specmoe.decoding.control.learning import Acceptance, Realized
from specmoe.decoding.control.measured import Arm, MeasuredArms
from specmoe.decoding.control.plan import Plan, PricedArm, PricedPlain, StepPlan
from specmoe.decoding.control.pricing import ArmPricing
from specmoe.decoding.control.view import StepView, young_rows

class Controller(ArmPricing, Coasting, StepFeedback):
    """Chooses each step (module docstring). Every choice is an *arm*: a plain step, or a speculative plan named by
    its drafter (mix). Which arm a step takes is decided by the arms' measured tokens/s in this process at this batch
    bucket (`measured.MeasuredArms`: successive elimination, exploration bounded to a small share of the steps);
    the cost model (refined per component, `CostModel.refine`, over unbiased acceptance estimates, corrected by what
    the arm's steps realized against its predictions, `Realized.slowdown`) prices each arm's per-row draft lengths,
    seeds the order unmeasured arms are tried in, prunes arms predicted far behind (on upper-confidence acceptance
    estimates: a drafter seen on few rows is not written off) and decides while nothing is measured. Reusing a call
    (`coasting.Coasting`), folding measured steps back in (`feedback.StepFeedback`) and pricing the candidate arms
    (`pricing.ArmPricing`) are mixed in. `force`
    ("plain" / "spec", None = choose) and `schedule` (a callable step index -> "plain" / "spec") override the
    choice, for tests and benchmarks; forced speculation drafts every sequence's full γ with the first drafter
    (what decoding="specmoe" does) but for the p_min floor (0 turns it off)."""

    SAVE_EVERY = 32  # steps between writes of the memory, ...
    SAVE_S = 1.0  # ... at least this many seconds apart (a write is ~1 ms: every 32 steps of 10 ms, 0.3%)
    SHORT = 2  # the fixed configurations offered as arms: each drafter drafting SHORT and γ_max tokens a row
    DECIDED = ("measured", "measured-near", "model")  # reasons of a choice a reused call may repeat (not a trial)
    OPTIMISM = 1.0  # upper-confidence acceptance estimates while a drafter is seen on few rows
    PER_ROW = False  # a drafter's per-row lengths offered as an arm ("eagle"; its mixes and trees always are)

    def __init__(self, cost: CostModel, gamma_max: int, drafters: tuple[str, ...] = ("self",), *,
                 p_min: float = 0.05):
        self.cost, self.g = cost, gamma_max
        self.names = list(drafters)
        self.width = 1  # > 1: tree arms too (`use`)
        self.planned: list[str] = list(drafters)  # the drafters the last `choose` planned over
        self.accs = {n: Acceptance.of(n, gamma_max) for n in self.names}  # the decoder records them
        self.p_min = p_min
        self.optimism = self.OPTIMISM
        self.force: str | None = None
        self.schedule = None
        self.steps = self.stops = 0
        self.free = True  # whether the step planned last could draft at all (a row short of its last token)
        self.measured = MeasuredArms()  # realized tokens/s per arm and batch bucket: what decides
        self.coasting, self.plain_rejoins = (frozenset(), 0), False  # (sequence ids, steps left) of a plain call
        # reused without planning; whether other sequences may join it (`Coasting._rejoin`)
        self.coast_steps = 3
        self.coast_max = 16  # the most steps a call is reused for while planning is dear ...
        self.coast_settled = 64  # ... or a measured call where nothing is left to explore (`_measured_coast`)
        # (sequence ids, plan, steps left) of a clear speculative call reused without planning (`coast_spec`)
        self.spec_coasting: tuple | None = None
        self.coast_above = 1.25  # a call is reused when it wins by this much (measured where both arms are)
        # any call is reused so when planning costs more than this share of the step it plans (the controller's
        # own time is what a step of a few ms loses to it)
        self.coast_share = 0.03
        self.plan_s: float | None = None  # EMA of a fresh plan's seconds
        self.outside: dict[int, float] = {}  # batch bucket -> EMA of a step's cycle seconds the model does not price
        self.learn_s: float | None = None  # EMA of `_learn_time`'s seconds
        self.learn_share = 0.003  # the share of a step the time model's learning may cost on reused-call steps
        self.learn_skip = 0  # reused-call steps left before the next one whose time is learned
        self.choices = {"plain": 0, "spec": 0}
        self.reasons: dict[str, int] = {}
        self.rows_by_drafter = dict.fromkeys(self.names, 0)
        self.realized = Realized()  # per arm and batch bucket: measured / predicted step seconds
        self.resident = self.spec_resident = None  # [L, E] the last plan's resident experts without / with self's set
        self.catchup: dict[str, np.ndarray] = {}  # the last plan's catch-up entries per drafter and row
        self.controller_s = 0.0
        self.pooled: dict[str, tuple] = {}  # drafter -> (step, [G+1] pooled accepted drafts by depth): `_pooled_cum`
        self.conf: dict[int, list[float]] = {}
        # (kind, B, predicted s, raw predicted s, measured s, predicted plain tok/s, best speculative tok/s)
        self.predictions: list[tuple] = []
        self.arm_rates: dict[str, float] = {}  # the last planned step's predicted tokens/s per arm (corrected)
        self.memory = None  # a ControllerMemory (`remember`)
        self.warmed: list[str] = []  # drafters whose estimates started from the memory
        self.learned = 0  # speculative steps folded in
        self.folded, self.saved_at = 0, 0.0  # steps folded in; when the memory was last written (`SAVE_EVERY`)

    @property
    def acc(self) -> Acceptance:  # the first drafter's acceptance (a single-drafter controller's)
        return self.accs[self.names[0]]

    @acc.setter
    def acc(self, value: Acceptance) -> None:
        self.accs[self.names[0]] = value

    TREE = "/tree"  # the suffix of a drafter's tree arm ("eagle/tree"), offered when the decoder drafts trees

    def use(self, drafters: list[str], width: int = 1) -> None:
        """Plan over these drafters (a decoder's, in its order: the first is forced speculation's); `width` > 1
        (the decoder verifies trees of that width): each drafter also has a tree arm beside its chain arms."""
        self.width = width
        for n in drafters:
            if n not in self.accs:
                self.accs[n] = Acceptance.of(n, self.g)
                self.rows_by_drafter[n] = 0
        self.names = list(drafters)

    def acceptance(self) -> dict[str, Acceptance]:
        """Each drafter's acceptance estimate, the one the decoder records and the tree selection prices with."""
        return self.accs

    def cost_model(self) -> CostModel:
        """The step-time model the plans price with, and the tree selection too (`CostModel.verify_line`)."""
        return self.cost

    def confidences(self, rows: list[int]) -> list[list[float]]:
        """The draft confidences the draft hook (`stopper`) read this step for these batch rows."""
        return [self.conf.get(b, []) for b in rows]

    def remember(self, memory) -> None:
        """Start each drafter's acceptance and the step-time corrections from `memory` (a `ControllerMemory`)
        and write them back every `SAVE_EVERY` steps, `SAVE_S` apart."""
        self.memory = memory
        self.warmed = memory.warm(self.accs)
        self.cost.warm(memory.section("cost"))
        self.realized.warm(memory.section("realized"))
        self.measured.warm(memory.section("measured"))

    def admit(self, seqs) -> None:
        """Sequences new to the decoder (ids are reused once a sequence finishes): nothing measured on an earlier
        holder of the id is theirs. A reused fixed configuration or plain call goes on for them (the workload's
        drafter and length: at batch 1 every request would otherwise plan its first steps afresh), a per-row one ends."""
        ids = [s.seq_id for s in seqs]
        for acc in self.accs.values():
            acc.forget(ids)
        self._forget_calls(ids)

    # ------------------------------------------------------------ the choice
    def choose(self, seq_ids: list[int], avail: dict[str, list[int]], resident: np.ndarray,
               spec_resident: np.ndarray, setup: dict[str, float] | None = None, young: bool = False) -> Plan:
        """`avail[d][b]`: the most drafter d may draft for sequence b (its limit; a lookup drafter: its
        proposal's length); `resident` / `spec_resident` [L, E]: resident experts for a step without / with the
        self draft's set; `setup[d]`: seconds drafter d would first spend on setup (the self draft's set);
        `young`: the rows are in their first tokens, where no trial starts (`MeasuredArms.pick`). Arms are priced
        at their steady draft (`ArmPricing._price`).
        Candidates → price → pick (by measured rate, `measured.MeasuredArms`) → explore → the Plan."""
        names = self.planned = [n for n in self.names if n in avail]
        B = len(seq_ids)
        want, reason = self._override()
        plain = self._price_plain(B, resident)
        cands = self._candidates(seq_ids, names, avail, forced=want == "spec")
        arms = self._price(cands, names, B, resident, spec_resident, setup or {})
        self.arm_rates = {"plain": plain.rate, **{tag: a.rate for tag, a in arms.items()}}
        best = max(arms.values(), key=lambda a: a.rate) if arms else None
        if want is None:
            pos = {d: acc.position() for d, acc in self.accs.items()}  # read once for all of a drafter's lengths
            offered = [Arm(t, a.rate, a.optimistic, self._spread(t, pos)) for t, a in arms.items()
                       if self.PER_ROW or t not in names]
            pick = self.measured.pick([Arm("plain", plain.rate, plain.rate, 0.0)] + offered, B, young)
            want, reason = ("plain" if pick.arm == "plain" else "spec"), pick.reason
            best = arms.get(pick.arm, best)
        else:
            self.measured.note("plain" if want == "plain" or best is None else best.tag)
        self.steps += 1
        self.choices[want if best is not None else "plain"] += 1
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        if want == "plain" or best is None:
            return self._plain_plan(seq_ids, plain, best, reason, resident)
        return self._spec_plan(seq_ids, plain, best, reason)

    def _spread(self, arm: str, pos: dict) -> float | None:
        """A fixed chain configuration's spread of tokens per step (`laps.spread`) on its drafter's acceptance by
        position now (`pos`: drafter -> `Acceptance.position()`); None for any other arm (a mix, a tree, per-row
        lengths)."""
        if not is_uniform(arm) or arm.endswith(self.TREE):
            return None
        d, g = uniform_parts(arm)
        return spread(pos[d], g) if d in pos else None

    def _override(self) -> tuple[str | None, str]:
        """A forced or scheduled step kind ("plain" / "spec"), else (None, "")."""
        if self.schedule is not None:
            return self.schedule(self.steps), "schedule"
        if self.force is not None:
            return self.force, "forced"
        return None, ""

    def _plain_plan(self, seq_ids: list[int], plain: PricedPlain, best: PricedArm | None, reason: str,
                    resident: np.ndarray) -> Plan:
        B = len(seq_ids)
        spec_rate = best.rate if best is not None else 0.0
        # a clear or forced call, or dear planning: the next steps reuse it without planning (not when nothing could
        # be drafted this step: a sequence at its last token, a lookup without a match)
        self.plain_rejoins = reason == "measured" and best is not None
        self.coast_trial = reason == "explore"
        if reason == "explore":  # a trial of plain: its next steps reuse its call (`Coasting._count_reused`)
            self.coasting = (frozenset(seq_ids), self.measured.trial_left("plain", B))
        elif self.plain_rejoins:  # measured the best: a plain step has nothing to go stale (others may join it)
            self.coasting = (frozenset(seq_ids), self._measured_coast(B))
        elif reason == "forced" or (reason in self.DECIDED and best is not None
                                    and (self._clear("plain", plain.rate, best.tag, spec_rate, B) or self._dear(B / plain.rate))):
            self.coasting = (frozenset(seq_ids), self._coast_len(B / plain.rate))
        _, miss = self.cost.expected_union(np.array([B]), resident, "plain")
        return Plan("plain", None, 1.0, B / plain.rate, plain.raw_s, float(miss.sum()), plain.rate, spec_rate,
                    reason, best.cand.gammas.astype(int).tolist() if best is not None else [0] * B, None,
                    [self.planned[i] for i in best.cand.who] if best is not None else [None] * B, "plain",
                    plain.raw_rate)

    def _spec_plan(self, seq_ids: list[int], plain: PricedPlain, best: PricedArm, reason: str) -> Plan:
        B, c = len(seq_ids), best.cand
        gam = c.gammas.astype(int)
        theta = 0.0 if reason in ("forced", "schedule") or c.theta is None else c.theta
        drafter_of = [n if g else None for n, g in zip([self.planned[i] for i in c.who], gam)]
        probs = np.zeros((B, self.g))
        for n in set(d for d in drafter_of if d):
            rows = [b for b, d in enumerate(drafter_of) if d == n]
            probs[rows] = self._probs(n, [seq_ids[b] for b in rows], np.full(len(rows), self.g), 0.0, False)
        plan = Plan("spec", gam.tolist(), theta, best.step_s, best.draft_s + best.verify_s, best.misses, plain.rate,
                    best.rate, reason, gam.tolist(), drafter_of, [self.planned[i] for i in c.who], c.tag, best.raw_rate, probs,
                    self.width if c.tag.endswith(self.TREE) or reason in ("forced", "schedule") else 1)
        if reason == "measured" and is_uniform(c.tag):  # a measured fixed configuration: nothing goes stale
            self.spec_coasting = (tuple(seq_ids), plan, self._measured_coast(B))
        elif reason == "explore" and is_uniform(c.tag):  # a trial's next steps reuse its call (`Coasting._count_reused`)
            self.spec_coasting = (tuple(seq_ids), plan, self.measured.trial_left(c.tag, B))
        elif reason in self.DECIDED and (self._clear(c.tag, best.rate, "plain", plain.rate, B) or self._dear(best.step_s)):
            self.spec_coasting = (tuple(seq_ids), plan, self._coast_len(best.step_s))  # the next steps reuse it
        return plan

    def _clear(self, arm: str, rate: float, other: str, other_rate: float, B: int) -> bool:
        """Whether `arm` wins over `other` by a clear margin (`coast_above`): on measured rates where both
        are measured at this batch bucket, else on predicted ones."""
        m, o = self.measured.rate(arm, B), self.measured.rate(other, B)
        if m is not None and o is not None:
            rate, other_rate = m, o
        return rate >= self.coast_above * other_rate

    def plan(self, seq_ids: list[int], limits: list[int], resident: np.ndarray, spec_resident: np.ndarray,
             setup_s: float = 0.0) -> Plan:
        """`choose` for the first drafter alone (every sequence may draft limits[b]); `specmoe plan`'s view."""
        return self.choose(seq_ids, {self.names[0]: limits}, resident, spec_resident, {self.names[0]: setup_s})

    # ------------------------------------------------------------ inside a step
    @property
    def layers(self) -> list[int]:  # the MoE layers the cost model prices (the decoder unpins a stale draft set there)
        return self.cost.routing.layers

    @property
    def observer(self):  # the runner observer that feeds the cost model the target's routing (the decoder's)
        return self.cost.routing.observe

    def plan_step(self, view: StepView) -> StepPlan:
        """The StepPlan of this step (the decoder's `plan`): a reused call, or a fresh `choose` over `view`."""
        t0 = time.perf_counter()
        B = len(view.seqs)
        self.free = any(view.limits)
        try:
            if self.coast(view.seq_ids):
                return StepPlan([None] * B, [0] * B, None)
            plan = self.coast_spec(view)
            if plan is None and self.coast(view.seq_ids):  # its rows may draft nothing now: one plain step
                return StepPlan([None] * B, [0] * B, None)
            if plan is None:
                t1 = time.perf_counter()
                plan = self._plan_fresh(view)
                dt = time.perf_counter() - t1
                self.plan_s = dt if self.plan_s is None else 0.8 * self.plan_s + 0.2 * dt
            if plan.kind == "plain":
                return StepPlan([None] * B, [0] * B, plan)
            self.conf = {}
            for n in plan.drafter_of:
                if n:
                    self.rows_by_drafter[n] += 1
            return StepPlan(plan.drafter_of, plan.gammas, plan, plan.width)
        finally:
            self.controller_s += time.perf_counter() - t0

    def _plan_fresh(self, view: StepView) -> Plan:
        """`choose` over what is resident now (without / with the self draft's set) and what each drafter has."""
        cm = self.cost
        cm.routing.flush()
        res = np.zeros((len(self.layers), cm.c.num_experts), dtype=bool)
        for i, layer in enumerate(self.layers):
            res[i, list(view.resident(layer))] = True
        spec_res, setup = res, {}
        ds = view.sets().get("self")
        if ds is not None:
            if ds.ids is not None:
                spec_res = res.copy()
                for i, layer in enumerate(self.layers):
                    spec_res[i, ds.ids[layer]] = True
            else:
                spec_res = res | cm.routing.hottest(ds.size)
            if ds.needs_setup:  # the draft set's experts not resident now load first
                setup["self"] = float((spec_res & ~res).sum()) * cm.c.read_s + cm.c.read_latency_s * len(self.layers)
        self.resident, self.spec_resident = res, spec_res
        avail = {n: view.available(n) for n in view.names}
        self.catchup = {n: np.asarray(view.catchup(n)) for n in view.names}  # what the step's timing is learned on
        young = young_rows(view.seqs, self.measured.YOUNG)  # (no trial starts in a request's first tokens)
        return self.choose(view.seq_ids, avail, res, spec_res, setup, young=young)

    def stopper(self, splan, name: str, rows: list[int], seqs, gammas: list[int]):
        """The draft hook of drafter `name` over its rows (batch rows `rows`, local gammas): records each greedy
        row's confidence and stops it once its running acceptance probability falls below the plan's θ or its
        calibrated acceptance probability below p_min."""
        plan = splan.decision
        if plan is None or plan.reason == "coast" and not plan.theta and is_uniform(plan.arm):
            return None  # nothing to stop: a reused call of a fixed configuration drafts as the fixed engine does
        acc = self.accs[name]
        run = np.ones(len(seqs))
        greedy = [s.params.greedy for s in seqs]
        theta = plan.theta if plan.reason not in ("forced", "schedule") else 0.0  # forced: the p_min floor only
        p_min = 0.0 if is_uniform(plan.arm) else self.p_min  # a fixed configuration's arm drafts its full length
        conf = {b: self.conf.setdefault(b, []) for b in rows}

        def hook(j: int, local: list[int], logits: torch.Tensor) -> None:
            c = torch.softmax(logits.float(), dim=-1).amax(-1).tolist()  # the draft's own confidence, one host read
            here = acc.by_confidence(np.asarray(c))  # calibrated: P(accepted | all before accepted)
            run[local] *= here
            for i, b in enumerate(local):
                conf[rows[b]].append(c[i])
                if greedy[b] and gammas[b] > j + 1 and (here[i] < p_min or run[b] < theta):
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
        st.update(self.measured.stats())  # what auto chose, its exploration share, each arm's measured tok/s
        return st
