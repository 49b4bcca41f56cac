"""Folding a measured step back into the controller's estimates (`Controller` mixes this in; its state is set up
in `Controller.__init__`): the plans' acceptance calibration on every speculative step (the acceptance itself is
recorded by the decoder, `SpeculativeDecoder.record_acceptance`); the step-time model's
refinements and each arm's realized correction on freshly planned steps and on one in a stride of a reused call's
steps."""
from __future__ import annotations

import math
import time

import numpy as np

from specmoe.decoding.control.candidates import is_uniform
from specmoe.decoding.control.plan import Plan
from specmoe.decoding.control.view import young_rows


class StepFeedback:
    """`learn` and its parts, over the controller's estimates (`accs`, `cost`, `realized`) and its plan's record."""

    def learn(self, splan, seqs, depths: list[int] | None, out: list[list[int]], clock, step_bytes: int) -> None:
        """Fold one step into the estimates: the plans' acceptance calibration (every speculative step), and the
        cost model's time and miss refinements against predictions for what the step really drafted (`_learn_time`:
        every freshly planned step; of the steps reusing a call, one in `_learn_stride` while folding a step in
        costs more than `learn_share` of it)."""
        plan = splan.decision
        chain = plan is not None and plan.kind == "spec" and plan.width == 1 and depths is not None
        self._learn_rate(plan, seqs, out, clock, self._pooled_tokens(splan, depths) if chain else None,
                         young_rows(seqs, self.measured.YOUNG))
        if plan is None:  # a coasting plain step
            return
        if plan.width > 1:  # a tree step: the time model and the plans' calibration price chains
            return
        measured = clock.priced_s()
        # a freshly planned step is timed, unless it took a measured fixed configuration (no prediction decided it)
        timed = not (plan.reason == "coast" or plan.reason == "measured" and is_uniform(plan.arm)) or self.learn_skip <= 0
        # the tokens the step was expected to emit, on the estimates before it (the realized correction compares)
        expect = self._expected_tokens(splan, seqs, depths) if timed and plan.kind == "spec" else len(seqs)
        if plan.kind == "spec":
            self._learn_acceptance(splan, plan, seqs, depths, out)
        if not timed:
            self.learn_skip -= 1
            return
        t0 = time.perf_counter()
        self._learn_time(splan, plan, seqs, depths, clock, step_bytes, measured,
                         expect, sum(len(o) for o in out))
        dt = time.perf_counter() - t0
        self.learn_s = dt if self.learn_s is None else 0.8 * self.learn_s + 0.2 * dt
        self.learn_skip = self._learn_stride(measured) - 1

    def _learn_rate(self, plan: Plan | None, seqs, out: list[list[int]], clock, pooled: float | None = None,
                    young: bool = False) -> None:
        """The step's realized tokens/s for its arm (what `auto` chooses by): tokens emitted over the step's seconds
        with its plan and the drafters' setup, and (a chain step) `pooled`, the tokens its drafts were worth on the
        drafter's pooled acceptance (`_pooled_tokens`); `young`: the rows were in their first tokens
        (`ArmRates.record`). A forced or scheduled speculative step is no arm's
        configuration."""
        if plan is not None and plan.kind == "spec" and plan.reason in ("forced", "schedule"):
            self.measured.interrupt()
        else:
            arm = "plain" if plan is None or plan.kind == "plain" else plan.arm
            planned = clock.wall("plan")
            if plan is not None and plan.reason == "explore":
                # a trial plans every step; the arm once chosen plans once per reused call (a fixed configuration or
                # plain: `coast_max` steps; a per-row plan: `coast_steps`): charged as it would be then (the ~2 ms
                # plan on each of a 10 ms trial step read eagle-g2 13% slower than the fixed engine runs)
                planned /= self.coast_max if arm == "plain" or is_uniform(arm) else self.coast_steps
            seconds = clock.step_s() + planned + clock.wall("setup")
            wait, lookups = clock.traffic()  # a trial's wait is credited for the moment's misses (`MissMoment`)
            self.measured.record(arm, len(seqs), sum(len(o) for o in out), seconds, self.steps, expected=pooled,
                                 wait=wait, lookups=lookups, choice=self.free, young=young)
        self.folded += 1
        due = self.folded % self.SAVE_EVERY == 0 and time.monotonic() - self.saved_at >= self.SAVE_S
        if self.memory is not None and due:
            self.saved_at = time.monotonic()
            self.memory.save(self.accs, cost=self.cost.state(), realized=self.realized.state(),
                             measured=self.measured.state())

    def _learn_stride(self, step_s: float) -> int:
        """1 in how many reused-call steps `_learn_time` runs: enough that it costs ~`learn_share` of the steps,
        at most `coast_max`."""
        if self.learn_s is None or step_s <= 0 or self.learn_s <= self.learn_share * step_s:
            return 1
        return min(self.coast_max, math.ceil(self.learn_s / max(self.learn_share * step_s, 1e-12)))

    @staticmethod
    def _rows_by_drafter(splan) -> dict[str, list[int]]:
        """The batch rows each drafter drafted this step."""
        rows: dict[str, list[int]] = {}
        for b, d in enumerate(splan.drafter_of):
            if d:
                rows.setdefault(d, []).append(b)
        return rows

    def _expected_tokens(self, splan, seqs, depths: list[int]) -> float:
        """B + the drafts each row was expected to get accepted at the depth it drafted (unbiased estimates)."""
        ids = [s.seq_id for s in seqs]
        total = float(len(seqs))
        for n, rows in self._rows_by_drafter(splan).items():
            total += float(self._probs(n, [ids[b] for b in rows], [depths[b] for b in rows], 0.0).sum())
        return total

    POOL_EVERY = 16  # steps between refreshes of a drafter's pooled position estimate (`_pooled_cum`)

    def _pooled_tokens(self, splan, depths: list[int]) -> float:
        """B + the drafts each row would get accepted at the depth it drafted, on its drafter's position estimate
        pooled over every sequence it drafted for (no sequence factor): what the step's drafts were worth on average
        text, whatever text this step landed on (`MeasuredArms` rates arms by it)."""
        total = float(len(depths))
        for n, rows in self._rows_by_drafter(splan).items():
            cum = self._pooled_cum(n)
            total += float(sum(cum[depths[b]] for b in rows))
        return total

    def _pooled_cum(self, name: str) -> np.ndarray:
        """[G+1]: expected accepted drafts of a row drafting j deep, on `name`'s position estimate (refreshed every
        `POOL_EVERY` steps: it moves little from one step to the next, and this runs on every step)."""
        hit = self.pooled.get(name)
        if hit is None or self.steps - hit[0] >= self.POOL_EVERY:
            hit = self.pooled[name] = (self.steps, np.concatenate([[0.0], np.cumsum(self.accs[name].position(0.0))]))
        return hit[1]

    def _learn_acceptance(self, splan, plan: Plan, seqs, depths: list[int], out: list[list[int]]) -> None:
        """The plans' calibration (what the plan expected of the rows it planned); the acceptance itself is recorded
        by the decoder (`SpeculativeDecoder.record_acceptance`), once for the controller and the selector."""
        for n, rows in self._rows_by_drafter(splan).items():
            if plan.reason != "coast" and plan.probs is not None:  # what the plan expected of the rows it planned
                self.accs[n].record_plan(plan.probs[rows], [plan.gammas[b] for b in rows],
                                         [len(out[b]) - 1 for b in rows])
        self.learned += 1

    def _learn_time(self, splan, plan: Plan, seqs, depths: list[int] | None, clock, step_bytes: int,
                    measured: float, expect: float, emitted: int) -> None:
        """The step-time model's refinements, and the arm's realized correction: seconds per emitted token measured
        against those predicted (by the model before this step's refinements, for the depths really drafted)."""
        cm = self.cost
        B = len(seqs)
        if plan.kind == "plain":
            self.realized.record("plain", B, measured, B / plan.raw_rate, self.steps)
            cm.refine_misses("plain", step_bytes / cm.c.expert_bytes, plan.predicted_misses)
            cm.refine(cm.fwd(B), B, clock.wall("verify"), plan.raw_s)
            cm.refine_overhead("plain", B, measured - clock.wall("verify"))
            self._log(plan, B, plan.predicted_s, plan.raw_s, measured)
            return
        names = self.names
        who = np.array([names.index(d) if d else -1 for d in splan.drafter_of])
        gam = np.array(depths)
        W, Gm = np.where(who >= 0, who, 0)[None], np.where(who >= 0, gam, 0)[None]
        predicted = float(self._costs(W, Gm, names, self.resident, self.spec_resident, {}, self.catchup)[2][0])
        self.realized.record(plan.arm, B, measured, predicted, self.steps, emitted, expect)
        draft_raw = {}
        for i, n in enumerate(names):
            mine = (who == i) & (gam > 0)
            if mine.any() and f"draft:{n}" in clock.spans:
                draft_raw[n] = float(self.draft_raw(n, mine[None], gam[None], self.catchup.get(n))[0])
                cm.refine(f"draft:{n}", B, clock.wall(f"draft:{n}"), draft_raw[n])
        n_tok = B + int(gam.sum())
        cm.routing.flush()  # the verification's routing: its union refines ρ
        cm.fold_union(B, int(gam.sum()))
        # priced as the plans price it (`Controller.verify_raw`), on the union refined by this step
        v_raw = float(self.verify_raw(B, gam[None], np.array(["self" in draft_raw]), self.resident,
                                      self.spec_resident)[0][0])
        cm.refine(cm.fwd(B), n_tok, clock.wall("verify"), v_raw)
        if plan.reason != "coast":  # a coasted step's gammas are not the ones its predictions were made for
            cm.refine_misses("spec", step_bytes / cm.c.expert_bytes, plan.predicted_misses)
        drafted = sum(clock.wall(f"draft:{n}") for n in names)
        cm.refine_overhead("spec", B, measured - drafted - clock.wall("verify"), B * (1 + int(gam.max())))
        if plan.reason != "coast":
            self._log(plan, B, plan.predicted_s, plan.raw_s, measured + clock.wall("setup"))

    def _log(self, plan: Plan, B: int, predicted: float, raw: float, measured: float) -> None:
        if len(self.predictions) < 20000:
            self.predictions.append((plan.kind, B, predicted, raw, measured, plan.plain_rate, plan.spec_rate))
