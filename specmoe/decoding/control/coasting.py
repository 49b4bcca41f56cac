"""Reusing a call without planning (the controller's own time is what a step of a few ms loses to it): after a
clear choice, or while planning is dear, the next steps of the same sequences repeat the last plan
(`Controller` mixes this in; its state is set up in `Controller.__init__`)."""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np

from specmoe.decoding.control.plan import Plan


class Coasting:
    """`coast` (a plain call) and `coast_spec` (a speculative one), and how many steps a call is reused for."""

    def coast(self, seq_ids: list[int]) -> bool:
        """True when this step repeats the last plain call without planning: after a plan that chose plain by a
        clear margin (or forced plain), or when planning costs more than `coast_share` of the step, the next
        `coast_steps` steps (more while planning is dear, `_coast_len`) of the same sequences do, those that
        finish leaving (the controller's own cost stays a small share of a plain step); a sequence that joins
        plans afresh."""
        ids, left = self.coasting
        if left <= 0 or self.schedule is not None or not set(seq_ids) <= ids:
            self.coasting = (frozenset(), 0)
            return False
        self.coasting = (ids, left - 1)
        self.steps += 1
        self.measured.note("plain")
        self.choices["plain"] += 1
        self.reasons["coast"] = self.reasons.get("coast", 0) + 1
        return True

    def coast_spec(self, view) -> Plan | None:
        """The last plan again, without planning, when it chose speculation by a clear margin
        (`coast_above` × the plain rate) or planning costs more than `coast_share` of the step, and this step's
        sequences were all in it (sequences that finished leave; one that joins plans afresh): for `coast_steps`
        steps (more while planning is dear, `_coast_len`) each row keeps its drafter and draft length (capped by
        what the drafter has now: a lookup's proposal, the sequence's limit; a row of a mix whose lookup has no
        proposal now drafts with the mix's model drafter), and the in-draft stopper still cuts drafts on their
        confidence."""
        if self.spec_coasting is None:
            return None
        ids, plan, left = self.spec_coasting
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
        gam = [min(plan.gammas[b], avail[d][i]) if d else 0 for i, (b, d) in enumerate(zip(keep, drafter_of))]
        if not any(gam):
            self.spec_coasting = None
            return None
        self.spec_coasting = (ids, plan, left - 1)
        self.catchup = {n: np.asarray(view.catchup(n)) for n in used}
        self.steps += 1
        self.measured.note(plan.arm)
        self.choices["spec"] += 1
        self.reasons["coast"] = self.reasons.get("coast", 0) + 1
        return replace(plan, gammas=gam, drafter_of=[d if g else None for d, g in zip(drafter_of, gam)],
                       spec_gammas=[plan.spec_gammas[b] for b in keep],
                       spec_drafters=[plan.spec_drafters[b] for b in keep],
                       probs=None if plan.probs is None else plan.probs[keep], reason="coast")

    def _dear(self, step_s: float) -> bool:
        """Whether planning costs more than `coast_share` of a step of step_s seconds."""
        return self.plan_s is not None and self.plan_s > self.coast_share * step_s

    def _coast_len(self, step_s: float) -> int:
        """Steps a call is reused for: `coast_steps`; while planning is dear, enough that one plan per reuse costs
        about `coast_share` of the steps it serves, at most `coast_max` (the plan's lengths go stale)."""
        if not self._dear(step_s):
            return self.coast_steps
        return min(self.coast_max, max(self.coast_steps, math.ceil(self.plan_s / (self.coast_share * step_s))))
