"""Recording an exploited arm's steps into a `MeasuredArms` (shared by the auto trial tests)."""
from __future__ import annotations

from specmoe.decoding.control.measured import MeasuredArms


def exploit(m: MeasuredArms, arm: str, steps) -> None:
    """Record `steps` [(tokens, seconds)] of `arm` at batch 1 as the exploited arm."""
    m.current[1] = arm
    for t, s in steps:
        m.record(arm, 1, t, s, m.steps)
        m.steps += 1
