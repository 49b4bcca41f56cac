"""`auto` credits a step's wait for expert loads on the wait per lookup pooled over every arm's recent steps
(`rates.PooledWait`, `ArmRates.record`), so a short trial that meets a run of misses is not ruled out for them;
and the engine hands it each step's wait and lookups for real (`PhaseClock.traffic`, `ExpertStore.lookups`)."""
from __future__ import annotations

import pytest

from specmoe import LLM, SamplingParams
from specmoe.decoding.control.measured import MeasuredArms
from specmoe.decoding.control.rates import PooledWait
from specmoe.engine.auto import controller_of
from tests.decoding.eagle_cases import prompts

# per arm: (tokens, compute seconds, experts looked up) of one step at batch 1; a deeper draft looks up more
G2, G4 = (2.4, 0.030, 30), (3.0, 0.045, 45)
MISS_S = 0.003  # seconds waited per expert looked up in a run of misses (none in a run of hits)


def _run(m: MeasuredArms, arm: str, step: tuple, misses: bool, credit: bool) -> None:
    tokens, compute, looked = step
    wait = looked * MISS_S if misses else 0.0
    m.record(arm, 1, tokens, compute + wait, m.steps, wait=wait if credit else 0.0, lookups=looked if credit else 0)
    m.steps += 1


@pytest.mark.parametrize("credit", [True, False])
def test_a_trial_that_meets_a_run_of_misses_is_rated_on_the_pooled_wait(credit):
    """eagle-g4 runs exploited through runs of 8 steps of hits and 8 of misses; eagle-g2's 4-step trial lands in a
    run of misses. Over both kinds of run eagle-g2 is the faster arm (2.4 tokens in 30 ms + 30 lookups' wait
    against 3.0 in 45 ms + 45 lookups'). Credited on the pooled wait it rates ahead of eagle-g4; on its raw seconds
    (the control: no wait handed over) its trial rates it behind, 2.4 / 120 ms."""
    m = MeasuredArms()
    m.current[1] = "eagle-g4"
    for k in range(64):
        _run(m, "eagle-g4", G4, misses=(k // 8) % 2 == 1, credit=credit)
    m.interrupt()
    _run(m, "eagle-g2", G2, misses=True, credit=credit)  # the switch's step (not measured)
    for _ in range(m.need(1)):
        _run(m, "eagle-g2", G2, misses=True, credit=credit)
    g2, g4 = m.rate("eagle-g2", 1), m.rate("eagle-g4", 1)
    truth_g2 = G2[0] / (G2[1] + G2[2] * MISS_S / 2)  # half the steps meet misses
    truth_g4 = G4[0] / (G4[1] + G4[2] * MISS_S / 2)
    assert truth_g2 > 1.1 * truth_g4
    if credit:
        assert g2 > 1.05 * g4, (g2, g4)
        assert g2 == pytest.approx(truth_g2, rel=0.2) and g4 == pytest.approx(truth_g4, rel=0.2)
        assert m.waits[1].lookups > 0
    else:
        assert g2 < 0.9 * g4, (g2, g4)
        assert 1 not in m.waits or m.waits[1].lookups == 0


def test_pooled_wait_credits_lookups_at_the_pooled_rate_and_leaves_steps_without_traffic_alone():
    p = PooledWait(HALF=1e9)  # (no decay: a plain ratio of sums)
    assert p.credit(0.05, 0.0, 0) == 0.05  # a resident step: nothing to credit
    assert p.credit(0.10, 0.06, 20) == pytest.approx(0.04 + 20 * 0.003)
    # a run of hits: its wait (0) replaced by its lookups at the pooled 0.06 / 40 s each
    assert p.credit(0.03, 0.0, 20) == pytest.approx(0.03 + 20 * 0.06 / 40)
    assert p.credit(0.08, 0.02, 10) == pytest.approx(0.06 + 10 * 0.08 / 50)


SP = SamplingParams(max_tokens=24, temperature=0.0)


def test_the_engine_hands_auto_each_steps_wait_and_lookups(tmp_path, monkeypatch):
    """An offloaded `auto` engine (8 of the demo's experts per layer cached, so steps miss): the controller's pooled
    wait saw the steps' lookups, as many as the cache counted (hits + misses) over the decode steps; a resident
    engine's saw none. Outputs equal plain greedy decoding."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    plain = [o.token_ids for o in LLM(dtype="float32", threads=1).generate(prompts(2), SP)]
    llm = LLM(dtype="float32", threads=1, offload="disk", cache_experts=8, decoding="auto")
    ctl = controller_of(llm)
    assert [o.token_ids for o in llm.generate(prompts(2), SP)] == plain
    st = llm.stats
    assert st["misses"] > 0 and st["fetch_wait_s"] > 0  # the steps did miss and wait
    pooled = ctl.measured.waits
    assert pooled and sum(p.lookups for p in pooled.values()) > 0
    assert llm.store.lookups == st["hits"] + st["misses"] > 0
    resident = LLM(dtype="float32", threads=1, decoding="auto")
    assert [o.token_ids for o in resident.generate(prompts(2), SP)] == plain
    assert resident.store.lookups == 0
    assert all(p.lookups == 0 and p.wait == 0 for p in controller_of(resident).measured.waits.values())
