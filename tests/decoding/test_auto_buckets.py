"""decoding="auto" at changing batch sizes (`control/measured.py`): which batch buckets are explored. A size a
batch only passes through (its ragged tail on the way down) pays no trials; the batch's own bucket is explored, even
when its tail runs longer than its full steps. Within a bucket, arms compare on steps of as many rows, and a batch
takes the shorter of two drafts that measure as fast (its tail is shorter)."""
from __future__ import annotations

import pytest

from specmoe.decoding.control.measured import Arm, MeasuredArms

from tests.decoding.test_auto_choice import drive, two_drafters


def watch(m) -> list[tuple[int, str]]:
    """(batch, reason) of every choice `m` (a `MeasuredArms`) makes from now on."""
    reasons = []
    orig = m.pick

    def pick(arms, B, young=False):
        p = orig(arms, B, young)
        reasons.append((B, p.reason))
        return p
    m.pick = pick
    return reasons


def test_a_batch_size_passing_through_a_bucket_is_not_explored_there():
    """A ragged tail (a few steps at a smaller batch, then back) exploits the nearest measured bucket's best arm and
    pays no trial there; once the batch stays in the bucket for SETTLE steps, the bucket is explored."""
    ctl, res, spec_res = two_drafters()
    speeds = {"plain": 2e-3, "self": 1.5e-3, "eagle": 1e-3}
    drive(ctl, res, spec_res, speeds, 300)
    m = ctl.measured
    reasons = watch(m)
    for _ in range(10):  # ten tails of 3 steps at batch 2, each followed by steps at batch 8 again
        drive(ctl, res, spec_res, speeds, m.SETTLE - 5, ids=[0, 1])
        drive(ctl, res, spec_res, speeds, 6)
    exploited = {k[0] for k, w in m.win.items() if k[1] == 2 and w}
    assert "explore" not in [r for _, r in reasons] and len(exploited) <= 1
    reasons.clear()
    drive(ctl, res, spec_res, speeds, 400, ids=[0, 1])  # the batch now stays at 2
    assert "explore" in [r for _, r in reasons] and m.rate("self", 2) is not None


def test_the_long_ragged_tail_of_a_larger_batch_is_not_explored():
    """A batch of 16 whose last row runs 12 steps alone (more than SETTLE) after each 10 steps at 16: the tail's
    bucket exploits what was measured elsewhere and pays no trial, however often it recurs; a batch that stays at 1
    is explored there."""
    ctl, res, spec_res = two_drafters()
    speeds = {"plain": 2e-3, "self": 1.5e-3, "eagle": 1e-3}
    big = list(range(16))
    drive(ctl, res, spec_res, speeds, 300, ids=big)
    m = ctl.measured
    reasons = watch(m)
    for _ in range(30):
        drive(ctl, res, spec_res, speeds, 10, ids=big)
        drive(ctl, res, spec_res, speeds, m.SETTLE + 4, ids=[0])
    assert (1, "explore") not in reasons and len({k[0] for k, w in m.win.items() if k[1] == 1 and w}) <= 1
    drive(ctl, res, spec_res, speeds, 400, ids=[0])
    assert (1, "explore") in reasons and m.rate("plain", 1) is not None


def test_a_batch_whose_ragged_tail_runs_longer_than_its_full_steps_is_explored_at_its_own_size():
    """Rounds of a batch of 8 (6 steps), each followed by its last row running 12 steps alone: the batch never
    spends SETTLE of 2·SETTLE steps at 8, yet 8 is the largest bucket of its steps (no size passed on the way
    down), so it is explored there; the tail at 1 is not."""
    ctl, res, spec_res = two_drafters()
    speeds = {"plain": 2e-3, "self": 1.5e-3, "eagle": 1e-3}
    drive(ctl, res, spec_res, speeds, 300, ids=[0])  # bucket 1 measured; 8 new
    m = ctl.measured
    reasons = watch(m)
    for _ in range(30):
        drive(ctl, res, spec_res, speeds, 6)
        drive(ctl, res, spec_res, speeds, 12, ids=[0])
    assert (8, "explore") in reasons and m.rate("plain", 8) is not None
    assert (1, "explore") not in reasons


def _steps(m, arm, steps) -> None:
    """Record `steps` [(rows, tokens/s)] of `arm`, 0.1 s each, after a switch step (not measured)."""
    m.interrupt()
    for rows, rate in steps[:1] + steps:
        m.record(arm, rows, rate * 0.1, 0.1, m.steps)


def test_arms_at_a_bucket_compare_on_steps_of_as_many_rows():
    """eagle-g2 exploited at 64 over whole batches: 1600 tok/s at 64 rows, 1400 once rows end (48): 1500 over its
    window. eagle-g4's trial, at a batch's start, ran 64 rows at 1620: ahead of 1500, not of g2's 1600 at 64 rows."""
    m = MeasuredArms()
    m.current[64] = "eagle-g2"
    _steps(m, "eagle-g2", [(64, 1600.0)] * 8 + [(48, 1400.0)] * 8)
    _steps(m, "eagle-g4", [(64, 1620.0)] * 2)
    assert m.rate("eagle-g2", 64) == pytest.approx(1500.0)  # (its whole window)
    arms = [Arm("eagle-g2", 1.0, 1.0), Arm("eagle-g4", 1.0, 1.0)]
    assert m._rows(["eagle-g2", "eagle-g4"], 64) == 64
    assert m._exploit(arms, 64).arm == "eagle-g2"
    _steps(m, "eagle-g4", [(64, 1800.0)] * 2)  # clearly ahead at 64 rows too: it takes over
    assert m._exploit(arms, 64).arm == "eagle-g4"


@pytest.mark.parametrize("B, g4, winner", [(64, 1650.0, "eagle-g2"), (1, 1650.0, "eagle-g2"),
                                           (64, 1800.0, "eagle-g4"), (1, 1800.0, "eagle-g4")])
def test_a_batch_takes_the_shorter_of_two_drafts_measured_as_fast(B, g4, winner):
    """At batch 64 eagle-g4's full steps measured 2% faster than eagle-g2's, but it finishes rows further apart and
    the batch's tail took 1.65x as long: within STAY the shorter draft is exploited; at batch 1 too (a deeper
    draft's credit leans on its deep positions' estimates, which read high); an arm clearly faster keeps it."""
    m = MeasuredArms()
    _steps(m, "eagle-g2", [(B, 1620.0)] * 8)
    m.current[B] = "eagle-g4"
    _steps(m, "eagle-g4", [(B, g4)] * 8)
    arms = [Arm("eagle-g2", 1.0, 1.0), Arm("eagle-g4", 1.0, 1.0)]
    assert m._exploit(arms, B).arm == winner
