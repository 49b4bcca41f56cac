"""`auto`'s re-measures: an arm measured ahead until its lead is clear or its window full, another length of the
exploited drafter measured again when old (`measured.MeasuredArms._target` / `_exploit`)."""
from __future__ import annotations

import pytest

from specmoe.decoding.control.measured import Arm, MeasuredArms, Pick
from tests.decoding.arm_steps import exploit


def test_an_arm_measured_ahead_but_not_clearly_is_measured_longer_before_stale_arms():
    """eagle-g4's one trial read above the exploited eagle-g2 on a window too short to be clear: its next burst
    comes before re-measuring an arm flagged stale by a drift, and adds to its window ("ahead")."""
    m = MeasuredArms()
    for arm, tokens in (("plain", 2.0), ("eagle+ngram", 3.4)):
        m.interrupt()
        exploit(m, arm, [(tokens, 0.01)] * (m.need(1) + 1))
    m.interrupt()
    exploit(m, "eagle-g2", [(2.6, 0.01), (3.4, 0.01)] * 16)
    m.interrupt()
    m.current[1] = "eagle-g2"
    for t in (2.0, 4.8, 1.6, 4.8, 2.0):  # (the switch's first step is no measurement)
        m.record("eagle-g4", 1, t, 0.01, m.steps)
        m.steps += 1
    m.stale.add(("eagle+ngram", 1))
    m.recent = type(m.recent)([1] * 16, maxlen=16)
    assert m.score("eagle-g4", 1) > m.score("eagle-g2", 1)
    assert m._exploit([Arm(n, 1.0, 1.0) for n in ("plain", "eagle-g2", "eagle-g4")], 1).arm == "eagle-g2"
    arms = [Arm(n, 1.0, 1.0) for n in ("plain", "eagle-g2", "eagle-g4", "eagle+ngram")]
    n = m.n("eagle-g4", 1)
    assert m._target(arms, 1, "eagle-g2") == ("eagle-g4", "ahead")
    assert m.pick(arms, 1) == Pick("eagle-g4", "explore") and m.n("eagle-g4", 1) == n  # (its window kept)


def test_an_arm_ahead_but_not_clear_is_measured_until_its_window_is_full_and_then_taken():
    """eagle-g4 reads 14% above the exploited plain over a noisy window of 3 x `need` steps, not clear: it is not
    taken yet and gets "ahead" bursts past that (they once stopped there, and plain held batch 4 while eagle-g4 ran
    1.17x faster), and once its window is full, still ahead by `STAY` though not by `Z` standard errors, it is
    taken."""
    m = MeasuredArms()
    exploit(m, "plain", [(1.0, 0.005)] * 32)  # plain: 200 tok/s, no spread
    m.interrupt()
    noisy = [(1.0, 0.01), (7.0, 0.01)]  # eagle-g4: 400 and 100/... alternating steps: 228 tok/s, wide spread
    m.current[1] = "plain"
    m.record("eagle-g4", 1, 1.0, 0.01, m.steps)  # (the switch's first step is no measurement)
    for t, s in noisy * (3 * m.need(1) // 2):
        m.record("eagle-g4", 1, t, s * 1.75, m.steps)
        m.steps += 1
    m.recent = type(m.recent)([1] * 16, maxlen=16)
    arms = [Arm(n, 1.0, 1.0) for n in ("plain", "eagle-g4")]
    assert m.n("eagle-g4", 1) == 3 * m.need(1)
    r4, r0 = m.score("eagle-g4", 1), m.score("plain", 1)
    assert r4 > m.STAY * r0 and r4 - r0 < m.Z * m.se_of(("eagle-g4", 1))  # ahead, not clear
    assert m._exploit(arms, 1).arm == "plain"
    assert m._target(arms, 1, "plain") == ("eagle-g4", "ahead")
    while m.n("eagle-g4", 1) < m.WINDOW - 1:
        t, s = noisy[m.n("eagle-g4", 1) % 2]
        m.record("eagle-g4", 1, t, s * 1.75, m.steps)
        m.steps += 1
    assert m._exploit(arms, 1).arm == "plain" and m._target(arms, 1, "plain") == ("eagle-g4", "ahead")
    while m.n("eagle-g4", 1) < m.WINDOW:
        t, s = noisy[m.n("eagle-g4", 1) % 2]
        m.record("eagle-g4", 1, t, s * 1.75, m.steps)
        m.steps += 1
    assert m.score("eagle-g4", 1) - r0 < m.Z * m.se_of(("eagle-g4", 1))  # still not clear by Z standard errors
    assert m._exploit(arms, 1).arm == "eagle-g4"


def test_a_lead_is_measured_on_the_second_opinion_budget():
    """With exploration at `SHARE` of the steps after the warm-up (no room for a trial of another kind), a burst
    measuring an arm ahead still starts, within `SECOND_SHARE`; a stale arm's re-measure does not."""
    def run(ahead: bool) -> Pick:
        m = MeasuredArms()
        swing = [(r, 0.01) for r in (1.5, 2.5) for _ in range(m.need(1))]  # 200 tok/s, moments 150 and 250
        exploit(m, "eagle-g2", swing * 4)
        m.interrupt()
        m.current[1] = "eagle-g2"
        for _ in range(m.need(1) + 1):  # (the switch's first step is no measurement)
            m.record("eagle-g4", 1, 2.3 if ahead else 1.9, 0.01, m.steps)
            m.steps += 1
        m.interrupt()
        exploit(m, "eagle-g2", swing)
        m.stale.add(("eagle-g4", 1))
        m.steps = 1000
        m.explored = int(m.SHARE * (m.steps - m.WARMUP))
        m.recent = type(m.recent)([1] * 16, maxlen=16)
        return m.pick([Arm(n, 1.0, 1.0) for n in ("eagle-g2", "eagle-g4")], 1)

    assert run(ahead=True) == Pick("eagle-g4", "explore")  # (not clear yet: not taken)
    assert run(ahead=False) == Pick("eagle-g2", "measured")


def test_another_length_behind_is_remeasured_when_old():
    """eagle-g4 read 0.75x the exploited eagle-g2 on one window, below `CLOSE` (another drafter that far behind is not
    re-measured when old) but within `SECOND`: as another length of the exploited drafter it is measured again once
    its reading is `STALE` steps old ("again", from a fresh window: its new reading stands, no second opinion)."""
    m = MeasuredArms()
    m.current[1] = "eagle-g2"
    exploit(m, "eagle-g2", [(2.0, 0.01)] * 32)  # 200 tok/s
    m.interrupt()
    m.current[1] = "eagle-g2"
    m.record("eagle-g4", 1, 3.0, 0.02, m.steps)  # (the switch's first step is no measurement)
    for _ in range(8):
        m.record("eagle-g4", 1, 3.0, 0.02, m.steps)  # 150 tok/s
    m.interrupt()
    exploit(m, "eagle-g2", [(2.0, 0.01)] * 32)
    m.steps += m.STALE + 1
    m.explored = 0
    m.recent = type(m.recent)([1] * 16, maxlen=16)
    arms = [Arm(n, 1.0, 1.0) for n in ("eagle-g2", "eagle-g4")]
    before = m.score("eagle-g4", 1)
    assert m.SECOND * m.score("eagle-g2", 1) < before < m.CLOSE * m.score("eagle-g2", 1)
    assert m._target(arms, 1, "eagle-g2") == ("eagle-g4", "again")
    assert m.pick(arms, 1) == Pick("eagle-g4", "explore") and m.n("eagle-g4", 1) == 0
    for _ in range(m.need(1) + 1):
        m.record("eagle-g4", 1, 3.0, 0.04, m.steps)  # 75 tok/s this time
        m.steps += 1
    assert m.score("eagle-g4", 1) == pytest.approx(75.0) and m.second_trials == 0


def test_a_lucky_trial_is_not_clear_against_the_spread_between_moments():
    """The exploited eagle-g2's blocks of `need` steps spread between moments (150 to 250 tok/s, steady within
    each); plain's one trial reads 15% above it on four identical steps. Its within-window spread is none, but one
    burst is one moment: the floor on its standard error (`se_of`) keeps it from being clear, so eagle-g2 stays and
    plain is measured further ("ahead"); with eagle-g2 as steady between moments as within, the same lead is taken."""
    def run(moments) -> tuple:
        m = MeasuredArms()
        exploit(m, "eagle-g2", [(r / 100.0, 0.01) for r in moments for _ in range(m.need(1))])
        m.interrupt()
        m.current[1] = "eagle-g2"
        rate = 1.15 * m.score("eagle-g2", 1)
        for _ in range(m.need(1) + 1):  # (the switch's first step is no measurement)
            m.record("plain", 1, rate / 100.0, 0.01, m.steps)
            m.steps += 1
        m.recent = type(m.recent)([1] * 16, maxlen=16)
        arms = [Arm(n, 1.0, 1.0) for n in ("plain", "eagle-g2")]
        return m, m._exploit(arms, 1).arm, m._target(arms, 1, "eagle-g2")

    m, arm, target = run([150.0, 250.0] * 4)
    assert m.moment_cv(1) > 0.2 and m.se_of(("plain", 1)) > 0.2 * m.score("plain", 1)
    assert arm == "eagle-g2" and target == ("plain", "ahead")
    m, arm, _ = run([200.0] * 8)
    assert m.moment_cv(1) == 0.0 and arm == "plain"


def test_a_reading_older_than_the_exploited_window_is_measured_again_before_it_is_taken():
    """plain's trial read 30% above eagle-g2's current window, but before any step of that window (another moment
    of the machine): eagle-g2 stays and plain is measured again from scratch ("recheck"); the same reading taken
    within eagle-g2's window is taken."""
    def run(trial_first: bool) -> tuple:
        m = MeasuredArms()
        m.current[1] = "eagle-g2"
        if not trial_first:
            exploit(m, "eagle-g2", [(2.0, 0.01)] * 32)  # 200 tok/s
        m.interrupt()
        m.current[1] = "eagle-g2"
        for _ in range(m.need(1) + 1):  # (the switch's first step is no measurement)
            m.record("plain", 1, 2.6, 0.01, m.steps)
            m.steps += 1
        m.interrupt()
        if trial_first:
            exploit(m, "eagle-g2", [(2.0, 0.01)] * 32)
        m.recent = type(m.recent)([1] * 16, maxlen=16)
        arms = [Arm(n, 1.0, 1.0) for n in ("plain", "eagle-g2")]
        return m._exploit(arms, 1).arm, m._target(arms, 1, "eagle-g2")

    arm, target = run(trial_first=True)
    assert arm == "eagle-g2" and target == ("plain", "recheck")
    assert run(trial_first=False)[0] == "plain"


def test_a_drift_does_not_flag_an_arm_measured_since_the_move():
    """eagle-g2's rate falls by 40%; plain was measured during its recent steps (after the move) and self-g2 before
    them: the drift flags self-g2 stale, not plain."""
    def trial(arm: str, tokens: float) -> None:  # a burst of need + 1 steps (the first: a switch's, unmeasured)
        m.interrupt()
        m.current[1] = "eagle-g2"
        for _ in range(m.need(1) + 1):
            m.record(arm, 1, tokens, 0.01, m.steps)
            m.steps += 1
        m.interrupt()

    m = MeasuredArms()
    exploit(m, "eagle-g2", [(3.0, 0.01)] * 20)  # 300 tok/s
    trial("self-g2", 2.5)
    exploit(m, "eagle-g2", [(3.0, 0.01)] * 12 + [(1.8, 0.01)] * 8)
    trial("plain", 1.7)
    assert m.drifts == 0
    exploit(m, "eagle-g2", [(1.8, 0.01)] * 8)
    assert m.drifts == 1 and ("self-g2", 1) in m.stale and ("plain", 1) not in m.stale
