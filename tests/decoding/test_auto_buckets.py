"""decoding="auto" at changing batch sizes (`control/measured.py`): which batch buckets are explored. A size a
batch only passes through (its ragged tail on the way down) pays no trials; the batch's own bucket is explored, even
when its tail runs longer than its full steps."""
from __future__ import annotations

from tests.decoding.test_auto_choice import drive, two_drafters


def watch(m) -> list[tuple[int, str]]:
    """(batch, reason) of every choice `m` (a `MeasuredArms`) makes from now on."""
    reasons = []
    orig = m.pick

    def pick(arms, B):
        p = orig(arms, B)
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
