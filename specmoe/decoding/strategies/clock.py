"""`PhaseClock`: wall time, routed-expert time and fetch wait of a step's phases, read around them (never inside)."""
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

    def _now(self) -> float:
        return now(self.runner.device) if self.sync else time.perf_counter()

    @contextlib.contextmanager
    def phase(self, name: str):
        r = self.runner
        t0, e0, w0 = self._now(), r.expert_s, r.provider.fetch_wait_s
        try:
            yield
        finally:
            w, e, f = self.spans.get(name, (0.0, 0.0, 0.0))
            self.spans[name] = (w + self._now() - t0, e + r.expert_s - e0, f + r.provider.fetch_wait_s - w0)

    def wall(self, name: str) -> float:
        return self.spans.get(name, (0.0,))[0]

    def step_s(self) -> float:
        """The step's own seconds as the controller prices them: draft, select, verify, accept, commit (not the
        admission of new sequences, the plan, nor the self draft's setup)."""
        return sum(self.wall(p) for p in ("draft", "select", "verify", "accept", "commit"))
