"""`auto` prices a closed batch's ragged tail per arm (`control/laps.py`): whole batches against their full steps."""
from __future__ import annotations

import pytest

from specmoe.decoding.control.laps import Laps
from specmoe.decoding.control.measured import Arm, MeasuredArms


def _lap(record, arm: str, full: int, tail: list[int], rows: int = 4, tok: float = 10.0, sec: float = 0.025,
         tail_tok: float = 2.5, tail_sec: float = 0.012) -> None:
    """One closed batch: `full` steps of `rows` rows, then a tail of steps at the given row counts."""
    for _ in range(full):
        record(arm, rows, tok, sec)
    for r in tail:
        record(arm, r, tail_tok * r, tail_sec)


def test_a_lap_runs_from_a_batch_that_grew_to_the_next_and_its_factor_is_the_tails():
    laps = Laps()
    _lap(laps.step, "eagle-g2", 10, [2, 1])
    assert laps.factor("eagle-g2", 4) is None  # not closed until the next batch grows
    _lap(laps.step, "eagle-g2", 10, [2, 1])  # (its first step closes the first lap)
    whole = (100.0 + 5.0 + 2.5) / (0.25 + 0.024)
    assert laps.factor("eagle-g2", 4) == pytest.approx(whole / (10.0 / 0.025))
    assert laps.of("plain", 4) == pytest.approx(laps.factor("eagle-g2", 4))  # no lap of its own: the bucket's
    assert laps.of("eagle-g2", 4) == pytest.approx(laps.factor("eagle-g2", 4))  # shrunk toward itself
    assert laps.of("eagle-g2", 1) == 1.0  # no lap peaked there


def test_a_lap_of_mixed_arms_or_with_a_step_of_no_arm_is_nobodys():
    laps = Laps()
    for arm in ("eagle-g2",) * 6 + ("eagle-g4",) * 4:  # a trial burst inside the full steps
        laps.step(arm, 4, 10.0, 0.025)
    laps.step("eagle-g2", 1, 2.0, 0.01)
    laps.step("eagle-g2", 4, 10.0, 0.025)
    laps.interrupt()
    laps.step("eagle-g2", 1, 2.0, 0.01)
    laps.step("eagle-g2", 4, 10.0, 0.025)
    assert laps.done == {}


def test_one_row_at_a_time_closes_no_lap():
    laps = Laps()
    for _ in range(50):
        laps.step("eagle-g2", 1, 3.0, 0.01)
    assert laps.done == {} and laps.of("eagle-g2", 1) == 1.0


def _two_arms(m: MeasuredArms, laps: int) -> str:
    """`laps` closed batches of each arm at batch 4: eagle-g4's full steps 6% faster than eagle-g2's, but its rows
    finish further apart (a tail of 5 slower steps against g2's 2: whole batches 372 tok/s against 394). The arm
    batch 4 exploits after."""
    rec = (lambda a, B, t, s: m.record(a, B, t, s, m.steps))
    for _ in range(laps):
        for arm, sec, tail, tail_sec in (("eagle-g2", 0.025, [2, 1], 0.012),
                                         ("eagle-g4", 0.025 / 1.06, [3, 2, 2, 1, 1], 0.02)):
            _lap(rec, arm, 12, tail, sec=sec, tail_sec=tail_sec)
    m.record("plain", 4, 4.0, 0.04, m.steps)  # the next batch: closes g4's last lap
    m.current[4] = "eagle-g2"
    return m._exploit([Arm("eagle-g2", 1.0, 1.0), Arm("eagle-g4", 1.0, 1.0)], 4).arm


def test_an_arm_whose_tail_costs_more_than_its_full_steps_gain_loses_the_batch():
    """Per step, g4 takes the batch; priced by its laps (8 of each arm), g2 keeps it."""
    m = MeasuredArms()
    assert _two_arms(m, 8) == "eagle-g2"
    laps, m.laps = m.laps, Laps()  # per step alone: g4
    assert m._exploit([Arm("eagle-g2", 1.0, 1.0), Arm("eagle-g4", 1.0, 1.0)], 4).arm == "eagle-g4"
    m.laps = laps
    assert m.laps.factor("eagle-g4", 4) < m.laps.factor("eagle-g2", 4) < 1.0
    assert m.laps.of("eagle-g4", 4) > m.laps.factor("eagle-g4", 4)  # shrunk toward the bucket's
    assert set(m.stats()["auto_lap_factors"]) == {"eagle-g2@4", "eagle-g4@4"}


def test_one_lap_does_not_overturn_a_lead_per_step():
    """A lap's tail is mostly its text's: one batch of each arm prices them near the bucket's factor alike, and the
    arm faster per step keeps the batch."""
    m = MeasuredArms()
    assert _two_arms(m, 1) == "eagle-g4"
    assert m.laps.factor("eagle-g4", 4) < m.laps.factor("eagle-g2", 4)  # its one lap did read worse


def test_what_the_laps_measured_is_remembered_by_the_next_controller():
    import json
    m = MeasuredArms()
    rec = (lambda a, B, t, s: m.record(a, B, t, s, m.steps))
    for _ in range(3):
        _lap(rec, "eagle-g4", 12, [3, 2, 2, 1, 1], tail_sec=0.02)
    m.record("plain", 4, 4.0, 0.04, m.steps)
    fresh = MeasuredArms()
    fresh.warm(json.loads(json.dumps(m.state())))
    assert m.laps.factor("eagle-g4", 4) < 0.95
    assert fresh.laps.factor("eagle-g4", 4) == pytest.approx(m.laps.factor("eagle-g4", 4))
    assert len(fresh.laps.done[("eagle-g4", 4)]) == 3  # as many laps: shrunk as much
    assert fresh.laps.priced("eagle-g4", 4, 0.9) == pytest.approx(m.laps.priced("eagle-g4", 4, 0.9))
    older = MeasuredArms()  # laps remembered before they kept their credit: credited with their peak tokens
    older.warm({"laps": {k: v[:5] for k, v in m.state()["laps"].items()}})
    assert older.laps.priced("eagle-g4", 4, 1.0) == pytest.approx(
        (3 * m.laps.factor("eagle-g4", 4) + older.laps.PRIOR * m.laps.factor("eagle-g4", 4)) / (3 + older.laps.PRIOR))
    fresh.warm({"laps": {"eagle-g2@x": [1, 1, 1, 1], "eagle-g2@4": [1, -1, 1, 1]}, "laps@2": "junk"})  # ignored
    assert set(fresh.laps.done) == {("eagle-g4", 4)}


def test_an_arm_whose_credit_reads_high_at_a_batch_size_is_priced_by_what_its_laps_realized():
    """eagle-g4's full steps at batch 4 are credited 10% above what they emit, while its calibration over all its
    steps (mostly accurate ones at batch 1) corrects only part of that: per step and calibration it measures 4%
    ahead of eagle-g2 and takes the batch; its laps, realizing tokens at eagle-g2's rate, keep eagle-g2."""
    def run(m: MeasuredArms) -> str:
        for _ in range(200):  # batch 1: credited as it emits
            m.record("eagle-g4", 1, 3.0, 0.01, m.steps, expected=3.0)
        for _ in range(8):
            for arm, credit in (("eagle-g2", 10.0), ("eagle-g4", 11.0)):
                for _ in range(12):
                    m.record(arm, 4, 10.0, 0.025, m.steps, expected=credit)
                for r in (2, 1):
                    m.record(arm, r, 2.5 * r, 0.012, m.steps, expected=2.5 * r)
        m.record("plain", 4, 4.0, 0.04, m.steps)  # the next batch: closes g4's last lap
        m.current[4] = "eagle-g2"
        return m._exploit([Arm("eagle-g2", 1.0, 1.0), Arm("eagle-g4", 1.0, 1.0)], 4).arm

    m = MeasuredArms()
    assert run(m) == "eagle-g2"
    assert len(m.laps.done[("eagle-g4", 4)]) == 8 and m.kappa("eagle-g4") > 0.94
    assert m.scale("eagle-g4", 4) < m.scale("eagle-g2", 4) / 1.08  # its laps priced its credit down
    shown = m.stats()["auto_lap_pricing"]  # what prices each arm, as llm.stats and --json show it
    assert shown["eagle-g4@4"] == pytest.approx(m.scale("eagle-g4", 4), abs=1e-4) and "eagle-g2@4" in shown
    # priced by calibration and the tail factor alone (the laps' credit unused), g4 takes the batch
    uncredited = MeasuredArms()
    uncredited.laps.priced = lambda arm, b, kappa: kappa * uncredited.laps.of(arm, b)
    assert run(uncredited) == "eagle-g4"


def test_steps_of_wide_batches_are_rated_by_what_they_emitted():
    """At batch 64 a step averages 64 rows' text, and the credit's own bias does not average out: eagle-g4's steps
    credited 30% above what they emit, eagle-g2's as they emit, g2 realizing 5% more tokens a second. Credited and
    calibrated by the arms' batch-1 steps (accurate), g4 would take the batch; rated by what the steps emitted, g2
    does. The calibration learns nothing from the wide steps, and batch 4 is still credited."""
    m = MeasuredArms()
    for arm in ("eagle-g2", "eagle-g4"):
        for _ in range(200):
            m.record(arm, 1, 3.0, 0.01, m.steps, expected=3.0)
        m.interrupt()
    for arm, tokens, credit in (("eagle-g2", 105.0, 105.0), ("eagle-g4", 100.0, 130.0)):
        for _ in range(8):
            m.record(arm, 64, tokens, 0.1, m.steps, expected=credit)
        m.interrupt()
    assert m.kappa("eagle-g4") == pytest.approx(1.0) and m.credits("eagle-g4", 64) == 1.0
    assert m.score("eagle-g4", 64) == pytest.approx(1000.0) and m.score("eagle-g2", 64) == pytest.approx(1050.0)
    assert m._exploit([Arm("eagle-g2", 1.0, 1.0), Arm("eagle-g4", 1.0, 1.0)], 64).arm == "eagle-g2"
    for _ in range(8):
        m.record("eagle-g4", 4, 8.0, 0.02, m.steps, expected=10.0)
    assert m.score("eagle-g4", 4) == pytest.approx(500.0 * m.kappa("eagle-g4")) and m.kappa("eagle-g4") < 1.0


def test_a_chains_spread_is_its_tokens_per_steps_deviation_over_the_root_of_their_mean():
    """Against the distribution written out: P(accepted = k) = P_k − P_{k+1}."""
    import itertools
    import math

    from specmoe.decoding.control.laps import spread
    P = [0.8, 0.59, 0.5, 0.42]
    for g in range(5):
        cum = [1.0] + P[:g] + [0.0]
        probs = [cum[k] - cum[k + 1] for k in range(g + 1)]
        mean = sum((1 + k) * p for k, p in enumerate(probs))
        var = sum((1 + k - mean) ** 2 * p for k, p in enumerate(probs))
        assert spread(P, g) == pytest.approx(math.sqrt(var / mean), abs=1e-12)
    assert spread(P, 0) == 0.0
    assert all(a < b for a, b in itertools.pairwise(spread(P, g) for g in range(5)))
    # (benchmarks/lap_tails.py at batch 64, demo, fp32: g3 and g4 lost 1.44x and 1.58x eagle-g2's tail)
    assert spread(P, 3) / spread(P, 2) == pytest.approx(1.39, abs=0.01)
    assert spread(P, 4) / spread(P, 2) == pytest.approx(1.74, abs=0.01)


def test_an_arm_without_laps_is_priced_by_the_tail_its_spread_predicts():
    laps = Laps()
    for _ in range(3):
        _lap(laps.step, "eagle-g4", 10, [3, 2, 1], tail_sec=0.02)
    laps.step("plain", 4, 4.0, 0.04)  # the next batch: closes the last lap
    loss = 1.0 - laps.factor("eagle-g4", 4)
    assert loss > 0.05
    assert laps.prior("eagle-g2", 4) == laps.pooled(4)  # no spreads known: the bucket's factor
    laps.spreads.update({"eagle-g4": 0.9, "eagle-g2": 0.5, "plain": 0.0})
    assert laps.prior("eagle-g2", 4) == pytest.approx(1.0 - loss * 0.5 / 0.9)  # one spread's laps: w = 0
    assert laps.of("eagle-g2", 4) == pytest.approx(laps.prior("eagle-g2", 4))
    assert laps.priced("eagle-g2", 4, 0.95) == pytest.approx(0.95 * laps.prior("eagle-g2", 4))
    assert laps.prior("plain", 4) == 1.0
    assert laps.prior("eagle+ngram", 4) == pytest.approx(laps.pooled(4))  # its spread unknown
    # eagle-g4 itself: shrunk toward its own prior (the fit through its laps: its factor)
    assert laps.of("eagle-g4", 4) == pytest.approx(laps.factor("eagle-g4", 4))
    # plain's laps tell the workload's own tail: the loss is fitted as w + c·spread
    for _ in range(3):
        _lap(laps.step, "plain", 10, [3], tok=4.0, sec=0.04, tail_tok=0.5, tail_sec=0.03)
    laps.step("eagle-g4", 4, 10.0, 0.025)
    w = 1.0 - laps.factor("plain", 4)
    assert 0.0 < w < loss
    assert laps.prior("eagle-g2", 4) == pytest.approx(1.0 - (w + (loss - w) / 0.9 * 0.5))


def test_a_shorter_draft_is_not_priced_with_a_deeper_ones_tail():
    """Batch 64: eagle-g4 ran whole batches whose tail cost it 25% of its full steps' rate; eagle-g2's trial
    measured its full steps 5% slower. With the drafts' spreads offered, eagle-g2 is priced by the tail its spread
    predicts (less than g4's) and takes the batch; priced with g4's tail (spreads unknown), g4 keeps it."""
    def run(spreads: dict) -> str:
        m = MeasuredArms()
        rec = (lambda a, B, t, s: m.record(a, B, t, s, m.steps))
        for _ in range(6):
            _lap(rec, "eagle-g4", 8, [48, 30, 16, 8, 4, 2, 1], rows=64, tok=190.0, sec=0.1, tail_tok=1.0,
                 tail_sec=0.06)
        m.current[64] = "eagle-g4"
        for _ in range(3):  # eagle-g2's trial: its full steps at a batch's start
            rec("eagle-g2", 64, 150.0, 0.1 * 150.0 / 190.0 * 1.05)
        arms = [Arm(n, 1.0, 1.0, spreads.get(n)) for n in ("eagle-g2", "eagle-g4")]
        m.pick(arms, 64)  # (records the offered spreads; may explore eagle-g2 further: two steps are one moment)
        return m._exploit(arms, 64).arm, m

    pick, m = run({"eagle-g2": 0.52, "eagle-g4": 0.9})
    assert pick == "eagle-g2"
    assert m.scale("eagle-g2", 64) > m.scale("eagle-g4", 64) * 1.1
    assert run({})[0] == "eagle-g4"


def test_the_controller_offers_each_fixed_chains_spread_on_its_drafters_acceptance(tmp_path, monkeypatch):
    """A real `auto` engine: plain is offered with spread 0, each fixed chain configuration with its spread on its
    drafter's acceptance (deeper drafts of one drafter spread more), and no arm whose spread is not known."""
    from specmoe import LLM, SamplingParams
    from specmoe.decoding.control.candidates import is_uniform, uniform_parts
    from specmoe.decoding.control.laps import spread
    from specmoe.engine.auto import controller_of
    from tests.decoding.eagle_cases import prompts
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    llm = LLM(dtype="float32", threads=1, decoding="auto")
    ctl = controller_of(llm)
    llm.generate(prompts(2), SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    got = ctl.measured.laps.spreads
    assert got.get("plain") == 0.0
    chains = {a: s for a, s in got.items() if a != "plain"}
    assert chains and all(is_uniform(a) and not a.endswith(ctl.TREE) for a in chains)
    for a, s in chains.items():
        d, g = uniform_parts(a)
        assert 0.0 < s and s == pytest.approx(spread(ctl.accs[d].position(), g), rel=0.5)
    pos = {d: acc.position() for d, acc in ctl.accs.items()}
    assert ctl._spread("eagle+ngram", pos) is None and ctl._spread("plain", pos) is None


def test_a_step_nothing_could_draft_is_its_batchs_but_no_arms_measurement():
    """Every row at its last token: the plain step is the only one possible. It counts in its batch's lap, and in
    no arm's window (the tails of batch 64 measured plain alone at buckets 1-4 and then ran plain there)."""
    m = MeasuredArms()
    for B in (4, 4, 2, 1):
        m.record("eagle-g2", B, 2.0 * B, 0.01, m.steps, expected=2.0 * B)
    for _ in range(8):
        m.record("plain", 1, 1.0, 0.005, m.steps, choice=False)
    assert m.n("plain", 1) == 0 and m.seen[1] == 9 and m.prev == "eagle-g2"
    m.record("plain", 4, 4.0, 0.01, m.steps)  # the next batch closes the lap: it ends in the 8 plain steps
    assert m.laps.factor("eagle-g2", 4) == pytest.approx((22.0 + 8.0) / (0.04 + 0.04) / 800.0)


def test_an_engines_last_token_steps_measure_no_arm():
    """A real engine: requests of 2 tokens take one decode step each, at their last token (nothing may draft)."""
    from specmoe import LLM, SamplingParams
    from specmoe.engine.auto import controller_of
    from tests.decoding.eagle_cases import prompts
    llm = LLM(dtype="float32", threads=1, decoding="auto", offload="host", cache_experts=8)
    for p in prompts(6):
        llm.generate([p], SamplingParams(max_tokens=2, ignore_eos=True))
    m = controller_of(llm).measured
    assert m.seen.get(1, 0) == 6 and not controller_of(llm).free
    assert "plain@1" not in llm.stats["auto_measured_steps"] and m.n("plain", 1) == 0
