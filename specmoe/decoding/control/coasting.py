"""Reusing a call without planning (the controller's own time is what a step of a few ms loses to it): after a
clear choice, or while planning is dear, the next steps of the same sequences repeat the last plan
(`Controller` mixes this in; its state is set up in `Controller.__init__`)."""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from specmoe.decoding.control.candidates import is_uniform, uniform_parts
from specmoe.decoding.control.plan import Plan
from specmoe.decoding.control.refinement import bucket


class Coasting:
    """`coast` (a plain call) and `coast_spec` (a speculative one), and how many steps a call is reused for."""

    coast_epoch = 0  # the measured arms' drift count the reused calls were made under (`_moved`)
    coasted: tuple | None = None  # (the call, what a reused step of it was made of, its Plan): `coast_spec`
    coast_trial = False  # the reused plain call is a trial's (`Controller._plain_plan`): it ends with its burst

    def _moved(self) -> bool:
        """Whether a drift was detected since the reused calls were made (the workload moved: stale arms are due
        a re-measure, which starts at a fresh plan): both calls end."""
        if self.measured.drifts == self.coast_epoch:
            return False
        self.coast_epoch = self.measured.drifts
        self.coasting, self.spec_coasting = (frozenset(), 0), None
        return True

    def coast(self, seq_ids: list[int]) -> bool:
        """True when this step repeats the last plain call without planning: after a plan that chose plain by a
        clear margin (or forced plain), or when planning costs more than `coast_share` of the step, the next
        `coast_steps` steps (more while planning is dear, `_coast_len`) of the same sequences do, those that
        finish leaving (the controller's own cost stays a small share of a plain step); a sequence that joins
        plans afresh, unless plain was the measured best at this batch bucket (`_rejoin`)."""
        if self._moved():
            return False
        ids, left = self.coasting
        if self.coast_trial and self.measured.trial_left("plain", len(seq_ids)) <= 0:
            left = 0  # a trial's call ends with its burst (or when the batch left its bucket)
        joins = not set(seq_ids) <= ids
        if left <= 0 or self.schedule is not None or (joins and not (self.plain_rejoins and self._rejoin(ids, seq_ids))):
            self.coasting = (frozenset(), 0)
            return False
        self.coasting = (frozenset(seq_ids) if joins else ids, left - 1)
        self.steps += 1
        self.choices["plain"] += 1
        self._count_reused("plain", len(seq_ids))
        return True

    def coast_spec(self, view) -> Plan | None:
        """The last plan again, without planning, when it chose speculation by a clear margin
        (`coast_above` × the plain rate) or planning costs more than `coast_share` of the step, and this step's
        sequences were all in it (sequences that finished leave; one that joins plans afresh): for `coast_steps`
        steps (more while planning is dear, `_coast_len`) each row keeps its drafter and draft length (capped by
        what the drafter has now: a lookup's proposal, the sequence's limit; a row of a mix whose lookup has no
        proposal now drafts with the mix's model drafter), and the in-draft stopper still cuts drafts on their
        confidence. A measured fixed configuration (`uniform`'s "eagle-g2") has nothing per row: a sequence that
        joins in the same batch bucket takes its drafter and length (`_rejoin`: at batch 1 every request would
        otherwise plan its first step afresh, ~1 ms of a 10 ms step)."""
        if self._moved() or self.spec_coasting is None:
            return None
        ids, plan, left = self.spec_coasting
        if plan.reason == "explore" and self.measured.trial_left(plan.arm, len(view.seq_ids)) <= 0:
            self.spec_coasting = None  # a trial's call ends with its burst (or when the batch left its bucket)
            return None
        joins = not set(view.seq_ids) <= set(ids)
        if joins and left > 0 and plan.reason == "measured" and is_uniform(plan.arm) and self._rejoin(ids, view.seq_ids):
            plan = self._uniform_plan(plan, len(view.seq_ids))
            ids = tuple(view.seq_ids)
        row = {sid: b for b, sid in enumerate(ids)}
        keep = [row.get(s) for s in view.seq_ids]
        if left <= 0 or self.schedule is not None or self.force is not None or None in keep:
            self.spec_coasting = None
            return None
        drafter_of = [plan.drafter_of[b] for b in keep]
        # a mix's model drafter ("eagle" of "eagle+ngram") drafts the rows whose lookup has nothing now
        model = plan.arm.split("+")[0] if "+" in plan.arm else None
        used = set(d for d in drafter_of if d) | ({model} if model else set())
        avail = {n: view.available(n) for n in used}
        if model:
            drafter_of = [model if d and d != model and not avail[d][i] else d for i, d in enumerate(drafter_of)]
        # a fixed configuration drafts its length wherever the drafter has it (the plan's were capped by the limits
        # and proposals of the step it was made on: a lookup's 1-token proposal then, a request's last tokens)
        want = [uniform_parts(plan.arm)[1]] * len(keep) if is_uniform(plan.arm) else [plan.gammas[b] for b in keep]
        gam = [min(w, avail[d][i]) if d else 0 for i, (w, d) in enumerate(zip(want, drafter_of))]
        if not any(gam):  # every row at its last token: a plain step (a measured fixed configuration's call
            if plan.reason == "measured" and is_uniform(plan.arm) and not any(view.limits):  # stays, unplanned)
                self.coasting, self.plain_rejoins, self.coast_trial = (frozenset(view.seq_ids), 1), False, False
            else:
                self.spec_coasting = None
            return None
        self.spec_coasting = (ids, plan, left - 1)
        if self.learn_skip <= 0:  # only a step whose time is learned prices its drafts (`StepFeedback.learn`)
            self.catchup = {n: np.asarray(view.catchup(n)) for n in used}
        self.steps += 1
        self.choices["spec"] += 1
        self._count_reused(plan.arm, len(keep))
        drafter_of = [d if g else None for d, g in zip(drafter_of, gam)]
        key = (tuple(keep), tuple(gam), tuple(drafter_of))
        c = self.coasted
        if c is not None and c[0] is plan and c[1] == key:  # the same call, rows, lengths and drafters as the
            return c[2]  # last reused step: its Plan again (plans are not mutated; `replace` is ~30 µs)
        out = replace(plan, gammas=gam, drafter_of=drafter_of, spec_gammas=[plan.spec_gammas[b] for b in keep],
                      spec_drafters=[plan.spec_drafters[b] for b in keep],
                      probs=None if plan.probs is None else plan.probs[keep], reason="coast")
        self.coasted = (plan, key, out)
        return out

    def _count_reused(self, arm: str, B: int) -> None:
        """Count a reused call's step with the bandit: a step of the exploration burst that made the call (a trial
        of a fixed configuration or plain reuses its first step's call: `trial_step`), else a step it did not
        choose (`note`)."""
        if self.measured.trial_step(arm, B):
            self.reasons["explore"] = self.reasons.get("explore", 0) + 1
        else:
            self.measured.note(arm)
            self.reasons["coast"] = self.reasons.get("coast", 0) + 1

    def _forget_calls(self, ids: list[int]) -> None:
        """Sequences new to the decoder under ids a reused per-row call planned for (ids are reused once a
        sequence finishes): that call's lengths were another sequence's, so it ends (a fixed configuration's
        goes on: nothing in it is per row)."""
        if self.spec_coasting is not None and not is_uniform(self.spec_coasting[1].arm) \
                and set(ids) & set(self.spec_coasting[0]):
            self.spec_coasting = None

    def _measured_coast(self, B: int) -> int:
        """Steps the measured best's call (plain or a fixed configuration) is reused for: `coast_max`, or
        `coast_settled` once the bandit finds nothing left to explore at this bucket (a fresh plan, ~1.4 ms at batch
        1, every 16 steps of ~10 ms cost ~1%; exploration and drift re-measures start at fresh plans); `coast_steps`
        while a trial waits for the rows to be past their first tokens (`MeasuredArms.deferred_at`)."""
        if self.measured.deferred_at(B):
            return self.coast_steps
        return self.coast_settled if self.measured.settled(B) else self.coast_max

    def _rejoin(self, ids, seq_ids: list[int]) -> bool:
        """Whether sequences not in a reused call may join it (the call was the measured best at its batch bucket:
        plain, `plain_rejoins`, or a fixed configuration, checked by the caller): the batch is in that bucket."""
        return bool(seq_ids) and bucket(len(seq_ids)) == bucket(max(len(ids), 1))

    def _uniform_plan(self, plan: Plan, B: int) -> Plan:
        """A fixed configuration's plan for B rows: every row its drafter and length (capped per step)."""
        d, g = uniform_parts(plan.arm)
        return replace(plan, gammas=[g] * B, drafter_of=[d] * B, spec_gammas=[g] * B, spec_drafters=[d] * B,
                       probs=None)

    def _dear(self, step_s: float) -> bool:
        """Whether planning costs more than `coast_share` of a step of step_s seconds."""
        return self.plan_s is not None and self.plan_s > self.coast_share * step_s

    def _coast_len(self, step_s: float) -> int:
        """Steps a call is reused for: `coast_steps`; while planning is dear, enough that one plan per reuse costs
        about `coast_share` of the steps it serves, at most `coast_max` (the plan's lengths go stale)."""
        if not self._dear(step_s):
            return self.coast_steps
        return min(self.coast_max, max(self.coast_steps, math.ceil(self.plan_s / (self.coast_share * step_s))))
