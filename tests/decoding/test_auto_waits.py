"""`auto` credits a trial step's wait for expert loads less the moment's excess wait per lookup, read off the
exploited arm (`rates.MissMoment`, `ArmRates.record`), so a short trial that meets a run of misses is not ruled out
for them, while each arm keeps its own wait per lookup and the exploited arm's steps stand as measured; and the
engine hands it each step's wait and lookups for real (`PhaseClock.traffic`, `ExpertStore.lookups`)."""
from __future__ import annotations

import random

import pytest

from specmoe import LLM, SamplingParams
from specmoe.decoding.control.measured import MeasuredArms
from specmoe.decoding.control.rates import MissMoment
from specmoe.engine.auto import controller_of
from tests.decoding.eagle_cases import prompts

# per arm: (tokens, compute seconds, experts looked up, its own wait per lookup relative to the moment's) of one
# step at batch 1; a deeper draft looks up more experts, plain's one token misses more of those it looks up
G2, G4, PLAIN = (2.4, 0.030, 30, 1.0), (3.0, 0.045, 45, 1.0), (1.0, 0.012, 12, 1.5)
MISS_S = 0.003  # seconds waited per expert looked up in a run of misses (none in a run of hits)


def _run(m: MeasuredArms, arm: str, step: tuple, misses: bool, credit: bool, per: float = MISS_S) -> None:
    tokens, compute, looked, own = step
    wait = looked * per * own if misses else 0.0
    m.record(arm, 1, tokens, compute + wait, m.steps, wait=wait if credit else 0.0, lookups=looked if credit else 0)
    m.steps += 1


@pytest.mark.parametrize("credit", [True, False])
def test_a_trial_that_meets_a_run_of_misses_is_rated_on_the_long_runs_misses(credit):
    """eagle-g4 runs exploited through runs of 16 steps of hits and 16 of misses (a request each); eagle-g2's
    4-step trial lands in a run of misses. Over both kinds of run eagle-g2 is the faster arm (2.4 tokens in 30 ms
    + 30 lookups' wait against 3.0 in 45 ms + 45 lookups'). With its wait credited less
    the moment's excess it rates ahead of eagle-g4's true rate, near its own; on its raw seconds (the control: no
    wait handed over) its trial rates it below eagle-g4's true rate, 2.4 / 120 ms."""
    m = MeasuredArms()
    m.current[1] = "eagle-g4"
    for k in range(64):
        _run(m, "eagle-g4", G4, misses=(k // 16) % 2 == 1, credit=credit)
    m.interrupt()
    _run(m, "eagle-g2", G2, misses=True, credit=credit)  # the switch's step (not measured)
    for _ in range(m.need(1)):
        _run(m, "eagle-g2", G2, misses=True, credit=credit)
    g2, g4 = m.rate("eagle-g2", 1), m.rate("eagle-g4", 1)
    truth_g2 = G2[0] / (G2[1] + G2[2] * G2[3] * MISS_S / 2)  # half the steps meet misses
    truth_g4 = G4[0] / (G4[1] + G4[2] * G4[3] * MISS_S / 2)
    assert truth_g2 > 1.1 * truth_g4
    if credit:
        assert g2 > 1.05 * truth_g4, (g2, g4)
        assert g2 == pytest.approx(truth_g2, rel=0.2)
        recent, long = m.moments[1].ratios()
        assert m.moments[1].arm == "eagle-g4" and recent > 1.5 * long  # the trial met more misses than usual
        assert m.moments[1].beta() > 0.7  # misses in runs: the moment foretells the next steps
        shown = m.stats()["auto_miss_moment"]["1"]  # what stats show of it
        assert shown["arm"] == "eagle-g4" and shown["beta"] == round(m.moments[1].beta(), 3)
        assert shown["ms_per_lookup"] == [round(1e3 * recent, 4), round(1e3 * long, 4)]
    else:  # (eagle-g4's own raw window drifts with the runs: its steps before the last run are dropped)
        assert g2 < 0.7 * truth_g2 and g2 < truth_g4, (g2, g4)
        assert m.moments[1].ratios() is None


def test_each_arm_keeps_its_own_wait_per_lookup():
    """At a steady miss rate (no moment to correct) every arm is rated on what it waited: plain, whose one token
    a step misses 1.5x as often per expert as eagle-g4's five (`PLAIN`, `G4`), is not credited eagle-g4's wait per
    lookup (a pooled wait per lookup rated plain 7% high and eagle-g4 7% low on the widened copy)."""
    m = MeasuredArms()
    m.current[1] = "eagle-g4"
    for _ in range(64):
        _run(m, "eagle-g4", G4, misses=True, credit=True, per=1e-3)
    m.interrupt()
    for _ in range(m.need(1) + 1):
        _run(m, "plain", PLAIN, misses=True, credit=True, per=1e-3)
    for arm, (tokens, compute, looked, own) in (("plain", PLAIN), ("eagle-g4", G4)):
        assert m.rate(arm, 1) == pytest.approx(tokens / (compute + looked * own * 1e-3), rel=1e-6)
    recent, long = m.moments[1].ratios()
    assert recent == pytest.approx(long)


def test_the_moment_is_the_exploited_arms_recent_wait_per_lookup_against_its_long_run():
    mo = MissMoment()
    mo.fold("eagle-g4", 0.0, 40)
    assert mo.ratios() is None and mo.credit(0.1, 0.05, 20) == 0.1  # not ready: nothing corrected
    for k in range(64):  # 8 steps of misses (1 ms a lookup), 8 of hits, in turn
        mo.fold("eagle-g4", 0.04 if (k // 8) % 2 == 0 else 0.0, 40)
    recent, long = mo.ratios()
    beta = mo.beta()
    assert 0.5 < beta <= 1.0  # runs of 8: the moment's excess carries into the next step, mostly
    assert recent < long  # it ends in a run of hits: a trial now is charged the long run's extra wait
    assert mo.credit(0.03, 0.0, 20) == pytest.approx(0.03 + beta * 20 * (long - recent))
    for _ in range(8):
        mo.fold("eagle-g4", 0.04, 40)
    recent, long = mo.ratios()
    beta = mo.beta()
    assert recent > long  # a run of misses: the excess is taken off a trial's wait ...
    assert mo.credit(0.07, 0.04, 40) == pytest.approx(0.07 - beta * 40 * (recent - long))
    # ... below none where it waited less than the excess (the excess averages 0), the step's seconds kept above
    # FLOOR × those without the wait
    below = mo.credit(0.035, 0.005, 40)
    assert below == pytest.approx(0.035 - beta * 40 * (recent - long)) and below < 0.03
    assert mo.credit(0.035, 0.005, 400) == pytest.approx(mo.FLOOR * 0.03)
    assert mo.credit(0.05, 0.0, 0) == 0.05  # a step that looked nothing up: nothing to credit
    mo.fold("eagle-g2", 0.02, 30)  # another arm exploited: its own long run starts over
    assert mo.arm == "eagle-g2" and mo.ratios() is None


def test_a_trial_like_the_exploited_arm_is_credited_what_it_waited_where_misses_come_in_independent_bursts():
    """No runs: one step in ten waits 20 ms (10 ms without). The moment's excess foretells nothing (`beta` near
    0), and a trial arm that behaves exactly like the exploited one is credited, over many steps, the seconds it
    took (within 1%; clamping its credited wait at none charged it 6% more), step by step nearly what it took (a
    full excess subtracted added its noise)."""
    rng = random.Random(1)
    mo = MissMoment()
    raw = credited = 0.0
    for k in range(40000):
        mo.fold("eagle-g2", 0.02 if rng.random() < 0.1 else 0.0, 10)
        if k % 5 == 0 and k > 200:
            wait = 0.02 if rng.random() < 0.1 else 0.0
            raw += 0.01 + wait
            credited += mo.credit(0.01 + wait, wait, 10)
    assert credited == pytest.approx(raw, rel=0.01)
    assert mo.beta() < 0.1
    recent, long = mo.ratios()
    assert abs(mo.credit(0.01, 0.0, 10) - 0.01) <= 0.1 * 10 * abs(recent - long) + 1e-12


def test_the_exploited_arms_own_steps_stand_as_measured():
    """Miss bursts on one step in ten (independent, no runs): crediting the exploited arm's steps by the moment its
    own steps make up read it 12% faster than it ran; they stand as measured."""
    m = MeasuredArms()
    m.current[1] = "eagle-g2"
    rng = random.Random(1)
    raw = []
    for _ in range(200):
        wait = 0.01 if rng.random() < 0.1 else 0.0
        raw.append((2.4, 0.01 + wait))
        m.record("eagle-g2", 1, 2.4, 0.01 + wait, m.steps, wait=wait, lookups=30)
        m.steps += 1
    window = raw[-m.n("eagle-g2", 1):]
    assert m.rate("eagle-g2", 1) == pytest.approx(sum(t for t, _ in window) / sum(s for _, s in window))
    assert m.moments[1].ratios() is not None  # (the moment was made up, and not applied to them)


SP = SamplingParams(max_tokens=24, temperature=0.0)


def test_the_engine_hands_auto_each_steps_wait_and_lookups(tmp_path, monkeypatch):
    """An offloaded `auto` engine (8 of the demo's experts per layer cached, so steps miss): the moment it credits
    waits by saw the exploited arm's lookups and waits, and the store counts hits + misses; a resident engine's
    saw no lookups. Outputs equal plain greedy decoding."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    plain = [o.token_ids for o in LLM(dtype="float32", threads=1).generate(prompts(2), SP)]
    llm = LLM(dtype="float32", threads=1, offload="disk", cache_experts=8, decoding="auto")
    ctl = controller_of(llm)
    assert [o.token_ids for o in llm.generate(prompts(2), SP)] == plain
    st = llm.stats
    assert st["misses"] > 0 and st["fetch_wait_s"] > 0  # the steps did miss and wait
    moments = ctl.measured.moments
    assert moments and sum(mo.long[1] for mo in moments.values()) > 0
    assert sum(mo.long[0] for mo in moments.values()) > 0
    assert llm.store.lookups == st["hits"] + st["misses"] > 0
    resident = LLM(dtype="float32", threads=1, decoding="auto")
    assert [o.token_ids for o in resident.generate(prompts(2), SP)] == plain
    assert resident.store.lookups == 0
    assert all(mo.long[:2] == (0.0, 0.0) for mo in controller_of(resident).measured.moments.values())
