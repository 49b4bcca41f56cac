"""`PhaseClock`: wall time, routed-expert time, fetch wait and expert lookups of a step's phases, read around them
(never inside)."""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

from specmoe.decoding.runtime.breakdown import now
from specmoe.decoding.runtime.runner import ModelRunner


@dataclass
class PhaseClock:
    """Per phase: (wall s, expert s, fetch wait s). `sync`: read the host time after the device finished what was
    queued (`breakdown.now`; a synchronisation on CUDA), else the host time as it is (the plain AR step's)."""
    runner: ModelRunner
    sync: bool = True
    spans: dict = field(default_factory=dict)  # phase -> (wall s, expert s, fetch wait s)
    looked: dict = field(default_factory=dict)  # phase -> experts its fetches were asked for (`ExpertStore.lookups`)

    def _now(self) -> float:
        return now(self.runner.device) if self.sync else time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str):
        r = self.runner
        p = r.provider
        t0, e0, w0, k0 = self._now(), r.expert_s, p.fetch_wait_s, p.lookups
        try:
            yield
        finally:
            w, e, f = self.spans.get(name, (0.0, 0.0, 0.0))
            self.spans[name] = (w + self._now() - t0, e + r.expert_s - e0, f + p.fetch_wait_s - w0)
            self.looked[name] = self.looked.get(name, 0) + p.lookups - k0

    def wall(self, name: str) -> float:
        return self.spans.get(name, (0.0,))[0]

    STEP = ("draft", "select", "verify", "accept", "commit")

    def step_s(self) -> float:
        """The step's own seconds, what a configuration's measured rate is made of: draft, select, verify, accept,
        commit (not the admission of new sequences, the plan, the self draft's setup, nor a drafter's catch-up)."""
        return sum(self.wall(p) for p in self.STEP)

    def priced_s(self) -> float:
        """The seconds the time model prices a step by: `step_s` and the drafters' catch-up (`Drafter.sync`, run
        before the draft phase; a measured rate leaves it out: it is the backlog of the steps before)."""
        return self.step_s() + self.wall("catchup")

    def traffic(self) -> tuple[float, int]:
        """(seconds waited for expert loads, experts looked up) in the step's own phases (`step_s`'s)."""
        return (sum(self.spans.get(p, (0.0, 0.0, 0.0))[2] for p in self.STEP),
                sum(self.looked.get(p, 0) for p in self.STEP))
