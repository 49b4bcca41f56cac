"""`auto`'s measured arms at unit level (`control/measured.py`, `MeasuredArms` alone, no controller): trials and
their order, second opinions, drift, lookup arms and each arm's calibration."""
from __future__ import annotations

import pytest

from specmoe.decoding.control.measured import Arm, MeasuredArms
from tests.decoding.arm_steps import exploit


def test_a_rate_that_swings_with_the_text_is_no_drift_but_a_lasting_fall_is():
    """At batch 1 a step's tokens follow the text: an arm emitting 1 or 5 tokens per step in turn (rate 300 over
    its window, its steps 100 or 500) is not drifting, so nothing is flagged for re-measurement; when its steps
    fall to 1 token for good, the others are flagged."""
    m = MeasuredArms()
    m.record("plain", 1, 1.0, 1 / 150, 0)
    for _ in range(6):
        m.record("plain", 1, 1.0, 1 / 150, 0)
    m.interrupt()
    noisy = [(1.0, 0.01), (5.0, 0.01)] * 8 + [(1.0, 0.01), (1.0, 0.01), (5.0, 0.01), (1.0, 0.01)] * 16
    exploit(m, "eagle", noisy)
    assert m.n("eagle", 1) == m.WINDOW and not m.stale  # (16 steps at 300, then 16 at 200: within the noise)
    assert m.drifts == 0
    for k in range(32):
        exploit(m, "eagle", [(1.0, 0.01)])
        if m.drifts:
            break
    assert ("plain", 1) in m.stale
    # the move ends reused calls (`Coasting._moved`), and the arm's own steps before it are dropped: what is left
    # is its new rate
    assert m.drifts == 1 and m.n("eagle", 1) == m.RECENT and m.rate("eagle", 1) == pytest.approx(100.0)


def test_arms_flagged_by_drift_are_measured_again_closest_to_the_best_first():
    m = MeasuredArms()
    for arm, rate in (("plain", 100.0), ("self", 180.0), ("ngram", 120.0)):
        m.interrupt()
        for _ in range(m.min_steps + 1):
            m.record(arm, 1, 1.0, 1 / rate, 0)
    m.interrupt()
    exploit(m, "eagle", [(2.0, 0.01)] * 16)
    m.stale |= {("plain", 1), ("self", 1), ("ngram", 1)}
    arms = [Arm(n, 1.0, 1.0) for n in ("plain", "self", "ngram", "eagle")]
    assert m._target(arms, 1, "eagle") == ("self", "again")


def test_from_wide_buckets_on_an_arm_counts_as_measured_after_half_the_steps():
    """At 64 rows a step's rate averages 64 rows: 2 steps measure an arm (4 below), and a trial is a burst of 3."""
    m = MeasuredArms()
    assert (m.need(32), m.need(64), m.need(256)) == (m.min_steps, 2, 2)
    for b in (32, 64):
        m.interrupt()
        for _ in range(3):
            m.record("plain", b, float(b), 0.1, 0)
    assert m.rate("plain", 64) is not None and m.rate("plain", 32) is None
    m.current[64] = "eagle"
    m.interrupt()
    for _ in range(3):
        m.record("eagle", 64, 128.0, 0.1, 0)
    m.steps, m.recent = 1000, type(m.recent)([64] * 16, maxlen=16)
    arms = [Arm(n, 1.0, 1.0) for n in ("plain", "eagle", "eagle-g2")]
    assert m._explore(arms, 64, "eagle") == "eagle-g2" and m.burst.left == 2  # 1 switch step + 2 measured


def test_arms_measured_on_different_text_compare_on_pooled_acceptance():
    """eagle-g4's 8 steps landed on easy text (4 tokens where its drafts were worth 3 on the drafter's pooled
    acceptance), eagle-g2's on hard text (1.5 where 2.2): by emitted tokens g4 measures faster (200 vs 120 tok/s), by
    what their drafts are worth per second g2 is (176 vs 150), and so it measures, its luck shrunk toward the
    drafter's calibration; a plain step is credited with what it emitted."""
    m = MeasuredArms()
    for _ in range(500):
        m.record("eagle", 1, 2.0, 0.01, 0, expected=2.0)
    for arm, tok, exp, sec in (("eagle-g4", 4.0, 3.0, 0.02), ("eagle-g2", 1.5, 2.2, 0.0125)):
        m.interrupt()
        for _ in range(9):
            m.record(arm, 1, tok, sec, 0, expected=exp)
    assert m.rate("eagle-g2", 1) > 1.05 * m.rate("eagle-g4", 1)
    assert m.kappa("eagle-g4") > 1.0 > m.kappa("eagle-g2")  # their own luck shows, shrunk
    m.interrupt()
    for _ in range(5):
        m.record("plain", 1, 1.0, 0.01, 0)
    assert m.rate("plain", 1) == pytest.approx(100.0) and m.kappa("plain") == pytest.approx(1.0)


def test_a_lookup_arm_measured_on_its_own_text_is_no_yardstick_at_a_new_bucket():
    """At batch 1 ngram-g4 (offered only where the lookup has a proposal: repetitive text) measured 2x eagle-g2;
    at batch 4 eagle-g2 is still tried (it is within NEAR of the best arm offered on every step there)."""
    m = MeasuredArms()
    for arm, rate in (("plain", 100.0), ("eagle-g2", 200.0), ("ngram-g4", 420.0)):
        m.interrupt()
        for _ in range(m.min_steps + 1):
            m.record(arm, 1, 1.0, 1 / rate, 0)
    assert not m._behind_near("eagle-g2", 4) and m._behind_near("plain", 4)
    m.interrupt()
    for _ in range(m.min_steps + 1):
        m.record("eagle", 1, 1.0, 1 / 400.0, 0)  # an arm offered on every step that does measure 2x
    assert m._behind_near("eagle-g2", 4)


def test_a_drift_re_measures_the_arms_within_reach_not_those_far_behind():
    m = MeasuredArms()
    for arm, rate in (("plain", 70.0), ("self-g2", 120.0), ("eagle-g4", 180.0)):
        m.interrupt()
        for _ in range(m.min_steps + 1):
            m.record(arm, 1, 1.0, 1 / rate, 0)
    m.interrupt()
    exploit(m, "eagle-g2", [(2.0, 0.01)] * 17 + [(2.0, 0.015)] * 16)  # 200 tok/s, then 133 (the first: a switch)
    assert m.stale == {("eagle-g4", 1), ("self-g2", 1)}  # within 0.6 x 133; plain (70) is not


def test_a_trial_cut_short_by_its_arm_not_being_offered_is_not_retried_soon():
    """ngram-g4 is offered on one step in three (a lookup with a match): its trial is cut, and the budget is not
    spent on it again for STALE steps."""
    m = MeasuredArms()
    for arm, rate in (("plain", 50.0), ("eagle-g2", 100.0)):
        m.interrupt()
        for _ in range(m.min_steps + 1):
            m.record(arm, 1, 1.0, 1 / rate, 0)
    m.current[1], m.steps, m.recent = "eagle-g2", 1000, type(m.recent)([1] * 16, maxlen=16)
    full = [Arm(n, 1.0, 1.0) for n in ("plain", "eagle-g2", "ngram-g4")]
    assert m._explore(full, 1, "eagle-g2") == "ngram-g4"
    assert m._explore(full[:2], 1, "eagle-g2") is None and ("ngram-g4", 1) in m.cut
    assert m._target(full, 1, "eagle-g2")[0] != "ngram-g4"
    m.steps += m.STALE
    assert m._target(full, 1, "eagle-g2") == ("ngram-g4", "new")
    # a trial cut by a request's end (nothing but plain offered: every row at its last token) is no lookup miss:
    # eagle-g4's trial goes on at the next request
    arms = full[:2] + [Arm("eagle-g4", 1.0, 1.0)]
    m.burst, m.cut = None, {}
    assert m._explore(arms, 1, "eagle-g2") == "eagle-g4"
    assert m._explore(full[:1], 1, "eagle-g2") is None and not m.cut
    assert m._target(arms, 1, "eagle-g2") == ("eagle-g4", "new")


def test_a_lookup_arm_takes_over_only_when_it_measures_clearly_faster_than_its_text_explains():
    """ngram-g4 is measured only on steps where its lookup matched (repetitive text, on which eagle-g2 runs faster
    too): 2% faster there does not take the bucket from eagle-g2; 2x faster does."""
    for ngram_rate, winner in ((390.0, "eagle-g2"), (800.0, "ngram-g4")):
        m = MeasuredArms()
        for arm, rate in (("eagle-g2", 382.0), ("ngram-g4", ngram_rate)):
            m.interrupt()
            for _ in range(3 * m.min_steps):
                m.record(arm, 4, 1.0, 1 / rate, 0)
        m.current[4] = "eagle-g2"
        arms = [Arm("eagle-g2", 1.0, 1.0), Arm("ngram-g4", 1.0, 1.0)]
        assert m._exploit(arms, 4).arm == winner
        m.current.pop(4)  # nothing exploited yet: the same
        assert m._exploit(arms, 4).arm == winner


def test_after_plain_the_exploited_arms_drafter_is_tried_first_and_a_bucket_settles_only_once_measured():
    """At a bucket where eagle-g4 is exploited and plain measured, eagle-g2 (the same drafter, another length) is
    tried before self-g4 though the model predicts self-g4 faster; the bucket is not `settled` (a reused call
    not lengthened) while the exploited arm itself is still being measured."""
    m = MeasuredArms()
    m.current[64], m.steps, m.recent = "eagle-g4", 1000, type(m.recent)([64] * 16, maxlen=16)
    arms = [Arm("plain", 1.0, 1.0), Arm("eagle-g4", 3.0, 3.0), Arm("self-g4", 2.9, 2.9), Arm("eagle-g2", 2.0, 2.0)]
    assert m._explore(arms, 64, "eagle-g4") is None and not m.settled(64)  # eagle-g4 measured first
    for arm in ("eagle-g4", "plain"):
        m.interrupt()
        for _ in range(m.need(64) + 1):
            m.record(arm, 64, 64.0, 0.05, m.steps)
    assert m._target(arms, 64, "eagle-g4") == ("eagle-g2", "new")


@pytest.mark.parametrize("again, rate, winner", [((1, 1, 1, 1), 260.0, "eagle-g2"),
                                                  ((2, 2, 2, 1), 2080 / 12, "eagle-g4")])
def test_an_arm_one_unlucky_trial_put_behind_is_tried_again_and_its_better_trial_stands(again, rate, winner):
    """eagle-g2 runs at 260 tok/s, but 2 of its 4 trial steps met a stall (twice as long): rated 173, behind the
    exploited eagle-g4 (240). RECENT steps later it gets a second trial; run clean, it takes over; stalled worse,
    the first trial's rate stands."""
    m = MeasuredArms()
    t = 2.0 / 260
    m.interrupt()
    for s in (t, t, 2 * t, t, 2 * t):  # (the first: the switch's, not measured)
        m.record("eagle-g2", 1, 2.0, s, 0)
    assert m.rate("eagle-g2", 1) == pytest.approx(2080 / 12) and m.trials[("eagle-g2", 1)] == 1
    m.interrupt()
    exploit(m, "eagle-g4", [(3.0, 3.0 / 240)] * 20)
    m.recent = type(m.recent)([1] * 16, maxlen=16)
    arms = [Arm(n, 1.0, 1.0) for n in ("eagle-g2", "eagle-g4")]
    assert m._exploit(arms, 1).arm == "eagle-g4"
    assert m._explore(arms, 1, "eagle-g4") == "eagle-g2" and m.n("eagle-g2", 1) == 0 and m.second_trials == 0
    m.interrupt()
    for k in (1,) + again:
        m.record("eagle-g2", 1, 2.0, k * t, m.steps)
    assert m.second_trials == 1 and not m.prior and m.trials[("eagle-g2", 1)] == 2
    assert m.rate("eagle-g2", 1) == pytest.approx(rate)
    assert m._exploit(arms, 1).arm == winner
    m.steps += 100
    assert m._target(arms, 1, "eagle-g4")[1] != "second"  # one second opinion


def test_a_second_opinion_comes_before_another_drafters_first_trial():
    """eagle-g2's one trial met a slow moment (0.72x the exploited eagle-g4); self+ngram, another drafter's mix the
    model ranks below, is not measured yet. The budget's next burst re-measures eagle-g2 first (at batch 4 it went
    to self+ngram while the fixed eagle-g2 engine ran 10% faster than eagle-g4); self+ngram's first trial follows."""
    m = MeasuredArms()
    t = 2.0 / 260
    m.interrupt()
    for s in (t, 1.4 * t, 1.4 * t, 1.4 * t, 1.4 * t):  # (the first: the switch's, not measured)
        m.record("eagle-g2", 1, 2.0, s, 0)
    assert m.trials[("eagle-g2", 1)] == 1
    m.interrupt()
    exploit(m, "eagle-g4", [(3.0, 3.0 / 260)] * 20)
    m.interrupt()
    for _ in range(m.need(1) + 1):
        m.record("plain", 1, 1.0, 1.0 / 150, m.steps)
        m.steps += 1
    m.recent = type(m.recent)([1] * 16, maxlen=16)
    arms = [Arm("plain", 1.0, 1.0), Arm("eagle-g4", 3.0, 3.0), Arm("eagle-g2", 2.5, 2.5), Arm("self+ngram", 2.8, 2.8)]
    assert m._exploit(arms, 1).arm == "eagle-g4"
    assert m._target(arms, 1, "eagle-g4") == ("eagle-g2", "second")
    assert m._explore(arms, 1, "eagle-g4") == "eagle-g2"
    m.interrupt()
    for _ in range(m.need(1) + 1):
        m.record("eagle-g2", 1, 2.0, t, m.steps)
        m.steps += 1
    assert m.second_trials == 1
    assert m._target(arms, 1, m._exploit(arms, 1).arm) == ("self+ngram", "new")


def test_an_arms_calibration_is_its_own_not_its_drafters_other_lengths():
    """eagle-g2 emits 1.1x what its drafts are worth on pooled acceptance (2000 steps), eagle-g4 0.9x (a trial of
    4): by what they emit, g2 runs 275 tok/s and g4 235. Shrunk toward g2's calibration, g4's trial would read 285
    and take over; its own calibration starts at 1 and g2 keeps the batch."""
    m = MeasuredArms()
    for _ in range(2000):
        m.record("eagle-g2", 4, 2.2, 0.008, 0, expected=2.0)
    m.interrupt()
    for _ in range(m.need(4) + 1):
        m.record("eagle-g4", 4, 2.7, 0.0115, 0, expected=3.0)
    assert m.kappa("eagle-g2") == pytest.approx(1.1, abs=0.01)
    assert m.kappa("eagle-g4") == pytest.approx(1.0, abs=0.01)
    assert m.rate("eagle-g2", 4) > 1.03 * m.rate("eagle-g4", 4)
    m.current[4] = "eagle-g2"
    assert m._exploit([Arm("eagle-g2", 1.0, 1.0), Arm("eagle-g4", 1.0, 1.0)], 4).arm == "eagle-g2"


def test_one_short_trial_somewhat_behind_at_a_neighbouring_bucket_does_not_rule_an_arm_out_at_a_new_one():
    """eagle-g2's one 4-step trial at batch 1 read 0.70x eagle-g4 (its fixed engine ran faster): at batch 4 it is
    still tried; measured longer that far behind, or far behind (below FAR) on one trial, it is not."""
    m = MeasuredArms()
    for arm, rate in (("eagle-g4", 250.0), ("eagle-g2", 175.0), ("self-g2", 125.0)):
        m.interrupt()
        for _ in range(m.min_steps + 1):
            m.record(arm, 1, 2.0, 2.0 / rate, 0)
    assert m.trials[("eagle-g2", 1)] == 1 and m.n("eagle-g2", 1) == m.need(1)
    assert not m._behind_near("eagle-g2", 4)
    assert m._behind_near("self-g2", 4)  # 0.5x: far behind on one trial
    for _ in range(2):  # measured longer, still 0.7x (the first: the switch's, not measured)
        m.record("eagle-g2", 1, 2.0, 2.0 / 175.0, 0)
    assert m.n("eagle-g2", 1) > m.need(1) and m._behind_near("eagle-g2", 4)


def test_a_lookup_arms_prediction_prunes_no_arm():
    """ngram-g4 (offered only where its lookup has a proposal) predicted 3x eagle's arms on the text it is offered
    on: eagle-g2, within PRUNE of the best arm offered on every step, is still tried; an arm predicted below PRUNE
    of that is not."""
    m = MeasuredArms()
    m.interrupt()
    for _ in range(m.min_steps + 1):
        m.record("plain", 1, 1.0, 1 / 150.0, 0)
    m.interrupt()
    m.current[1] = "eagle-g4"
    for _ in range(m.min_steps + 1):
        m.record("eagle-g4", 1, 3.0, 3.0 / 250.0, 0)
    arms = [Arm("plain", 150.0, 150.0), Arm("eagle-g4", 250.0, 260.0), Arm("eagle-g2", 240.0, 250.0),
            Arm("self-g2", 120.0, 130.0), Arm("ngram-g4", 750.0, 800.0)]
    assert m._target(arms, 1, "eagle-g4") == ("eagle-g2", "new")
    m.interrupt()
    for _ in range(m.min_steps + 1):
        m.record("eagle-g2", 1, 2.0, 2.0 / 240.0, 0)
    assert m._target(arms, 1, "eagle-g4") == ("ngram-g4", "new")  # self-g2 (0.52x eagle-g4's 250) is pruned


def test_a_second_opinion_finds_room_where_a_first_trial_would_not():
    """After the warm-up, exploration has taken 9 of 300 steps (3%): a 5-step burst would take it past SHARE (4%),
    not past SECOND_SHARE. eagle-g2's one trial put it within SECOND of the exploited eagle-g4: its second opinion
    runs; with no second opinion due (its trial too far behind), nothing is explored."""
    def setup(slow):
        m = MeasuredArms()
        t = 2.0 / 260
        m.interrupt()
        for s in (t,) + (slow * t,) * 4:  # (the first: the switch's, not measured)
            m.record("eagle-g2", 1, 2.0, s, 0)
        m.interrupt()
        exploit(m, "eagle-g4", [(3.0, 3.0 / 260)] * 20)
        m.steps, m.explored = m.WARMUP + 300, 9
        m.recent = type(m.recent)([1] * 16, maxlen=16)
        return m
    arms = [Arm("eagle-g4", 3.0, 3.0), Arm("eagle-g2", 2.5, 2.5)]
    m = setup(1.4)
    length = m.need(1) + 1
    assert not m._budget(length) and m._budget(length, m.SECOND_SHARE)
    assert m._target(arms, 1, "eagle-g4") == ("eagle-g2", "second")
    assert m._explore(arms, 1, "eagle-g4") == "eagle-g2"
    m = setup(2.5)  # 0.4x of eagle-g4: no second opinion, and no room for anything else
    assert m._target(arms, 1, "eagle-g4")[1] != "second"
    assert m._explore(arms, 1, "eagle-g4") is None


def test_another_length_of_a_measured_drafter_is_never_pruned():
    """The model's step times can misjudge a drafter's lengths against each other (the widened copy at batch 16:
    eagle-g2 predicted 0.56x eagle-g4 while its fixed engine ran at least as fast): once a fixed configuration of a
    drafter is measured at a bucket, its other lengths are tried there whatever their prediction; another
    drafter's arm predicted as far behind still is not."""
    m = MeasuredArms()
    m.interrupt()
    for _ in range(m.min_steps + 1):
        m.record("plain", 16, 16.0, 16 / 300.0, 0)
    m.current[16] = "plain"
    arms = [Arm("plain", 300.0, 300.0), Arm("eagle-g4", 500.0, 520.0), Arm("eagle-g2", 280.0, 290.0),
            Arm("self-g2", 250.0, 260.0)]
    assert m._target(arms, 16, "plain") == ("eagle-g4", "new")  # eagle-g2 and self-g2: below 0.6 of 500
    m.interrupt()
    for _ in range(m.min_steps + 1):
        m.record("eagle-g4", 16, 40.0, 40 / 290.0, 0)
    assert m._target(arms, 16, "plain") == ("eagle-g2", "new")
    m.interrupt()
    for _ in range(m.min_steps + 1):
        m.record("eagle-g2", 16, 30.0, 30 / 310.0, 0)
    assert m._target(arms, 16, "eagle-g2")[0] != "self-g2"


def test_no_trial_starts_in_a_requests_first_tokens():
    """A request's first tokens run slower on every arm (its experts are not cached yet): while the rows are
    `young`, an arm due for a trial is not tried; once they are past `YOUNG` tokens it is. A burst already running
    goes on."""
    m = MeasuredArms()
    for arm in ("plain", "eagle-g4"):
        m.interrupt()
        exploit(m, arm, [(2.0, 0.01)] * (m.need(1) + 1))
    m.recent = type(m.recent)([1] * 16, maxlen=16)
    arms = [Arm(n, 1.0, 1.0) for n in ("plain", "eagle-g4", "eagle-g2")]
    assert m.pick(arms, 1, young=True).reason == "measured" and m.burst is None and m.deferred_at(1)
    # a pick that does not explore the bucket (a larger batch's ragged tail passing through) puts nothing off: the
    # exploited arm's call may be reused in full
    m.recent.extend([4, 4])
    assert m.pick(arms, 1, young=True).reason == "measured" and not m.deferred_at(1)
    m.recent.extend([1] * 16)
    assert m.pick(arms, 1, young=True).reason == "measured" and m.deferred_at(1)
    first = m.pick(arms, 1)
    assert (first.arm, first.reason) == ("eagle-g2", "explore") and m.burst.left > 0
    assert m.pick(arms, 1, young=True) == first  # (a running burst is not cut by a new request)


def test_the_controller_starts_no_trial_while_its_rows_are_young():
    """Through `Controller.plan_step` (the view's rows and their generated tokens): with self-g2 due for a trial
    (self-g4 exploited, plain measured), a step whose row has generated fewer than `YOUNG` tokens takes self-g4,
    whose call is then reused only `coast_steps` steps (not `coast_max`: at batch 64 the next fresh plan fell in the
    batch's tail, and no trial ever started at its full size), and the fresh plan after them, the row past its first
    tokens, starts self-g2's trial."""
    from types import SimpleNamespace

    from specmoe.decoding.control.view import StepView
    from tests.decoding.test_controller import synthetic
    ctl, _, _ = synthetic(read_s=5e-3)
    ctl.PER_ROW = False
    m = ctl.measured
    for arm in ("plain", "self-g4"):
        m.interrupt()
        exploit(m, arm, [(2.0, 0.01)] * (m.need(1) + 1))
    m.recent = type(m.recent)([1] * 16, maxlen=16)

    def view(age):
        seq = SimpleNamespace(seq_id=0, params=SimpleNamespace(greedy=True, max_tokens=64), output_ids=[0] * age)
        return StepView([seq], [4], ("self",), lambda n: [4], lambda n: [0], lambda layer: [], lambda: {})
    young = ctl.plan_step(view(m.YOUNG - 1)).decision
    assert (young.arm, young.reason) == ("self-g4", "measured") and m.burst is None and m.deferred_at(1)
    reused = [ctl.plan_step(view(m.YOUNG)).decision for _ in range(ctl.coast_steps)]
    assert [(p.arm, p.reason) for p in reused] == [("self-g4", "coast")] * ctl.coast_steps
    assert ctl.coast_steps < ctl.coast_max
    old = ctl.plan_step(view(m.YOUNG)).decision
    assert (old.arm, old.reason) == ("self-g2", "explore") and m.burst is not None


@pytest.mark.parametrize("self_rate, tried", [(100.0, False), (180.0, True)])
def test_a_drafter_measured_far_behind_has_its_other_lengths_left_untried(self_rate, tried):
    """self-g2 measured at 0.4x the exploited eagle-g2 (250 tok/s): self-g4, unmeasured, is not tried (its trial
    would run a round's steps at about that speed); at 0.72x it is."""
    m = MeasuredArms()
    for arm, rate in (("plain", 140.0), ("self-g2", self_rate)):
        m.interrupt()
        exploit(m, arm, [(2.0, 2.0 / rate)] * (m.need(1) + 1))
    m.trials[("self-g2", 1)] = 2  # (past its second opinion)
    m.interrupt()
    exploit(m, "eagle-g2", [(2.0, 2.0 / 250)] * 20)
    m.recent = type(m.recent)([1] * 16, maxlen=16)
    arms = [Arm(n, 1.0, 1.0) for n in ("plain", "eagle-g2", "self-g2", "self-g4")]
    assert m._target(arms, 1, "eagle-g2") == (("self-g4", "new") if tried else (None, ""))


def test_steps_in_a_requests_first_tokens_count_in_the_lap_and_calibration_not_the_window():
    """A young step (rows in their first `YOUNG` tokens, slower on every arm) is left out of the arm's window,
    where a trial, which never starts there, could not match it; its lap and calibration still take it."""
    m = MeasuredArms()
    m.current[1] = "eagle-g2"
    for young in (True, True, False, False):
        m.record("eagle-g2", 1, 2.0, 0.01, m.steps, expected=2.5, young=young)
        m.steps += 1
    assert m.n("eagle-g2", 1) == 2  # the two old steps; the young ones are in no window
    assert m.real["eagle-g2"] == [8.0, 10.0]  # all four calibrate the credit


def test_rows_are_young_in_the_first_tokens_of_requests_long_enough_to_have_more():
    """`young_rows`: the rows' mean generated tokens below `first`, for requests at least 4x as long; a workload of
    short requests is all first tokens, and is measured as it is (else nothing would ever be measured)."""
    from types import SimpleNamespace

    from specmoe.decoding.control.view import young_rows

    def rows(done, max_tokens):
        return [SimpleNamespace(output_ids=[0] * d, params=SimpleNamespace(max_tokens=max_tokens)) for d in done]
    assert young_rows(rows([0, 4], 32), 8) and not young_rows(rows([8, 8], 32), 8)
    assert not young_rows(rows([0, 4], 16), 8)  # 16-token requests: no part of them is past their first tokens
