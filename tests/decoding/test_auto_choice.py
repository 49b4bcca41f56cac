"""decoding="auto" chooses by measured speed (`control/measured.py`): over injected step times (a fake clock), the
controller converges to the arm that measures fastest whatever the cost model predicts, keeps its exploration within
5% of the steps after the first 64, re-explores when the realized rate drifts or at a batch bucket not measured yet,
remembers what it measured, and reports it through `llm.stats`."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from specmoe.decoding.control.controller import Controller
from specmoe.decoding.control.measured import Arm, MeasuredArms
from specmoe.engine.auto import controller_of

from tests.decoding.test_controller import auto_llm, synthetic
from tests.decoding.test_specmoe import BATCHES, reference


def two_drafters():
    """A controller over ("self", "eagle") whose cost model predicts self (the first drafter) faster than eagle and
    both faster than plain: self's rows are estimated to accept every draft, eagle's 3 of 4."""
    base, res, spec_res = synthetic(read_s=5e-4)
    ctl = Controller(base.cost, base.g, ("self", "eagle"))
    ctl.PER_ROW = True
    ids = list(range(8))
    for _ in range(20):
        ctl.accs["self"].record(ids, [4] * 8, [4] * 8, [[0.9] * 4] * 8)
        ctl.accs["eagle"].record(ids, [4] * 8, [3] * 8, [[0.9] * 4] * 8)
    return ctl, res, spec_res


def drive(ctl, res, spec_res, seconds_per_token: dict[str, float], steps: int, ids=None) -> list[str]:
    """Run `steps` choices; each step of drafter a's arms emits 2 tokens a row (1 for plain) in tokens ×
    seconds_per_token[a] seconds (the fake clock), folded in through the controller's own feedback (`_learn_rate`)
    → the drafters chosen."""
    ids = list(range(8)) if ids is None else ids
    lim = [4] * len(ids)
    chosen = []
    for _ in range(steps):
        plan = ctl.choose(ids, {"self": lim, "eagle": lim}, res, spec_res)
        arm = plan.arm.split("-g")[0]  # short drafts ("eagle-g2") measure as their drafter's here
        tokens = len(ids) * (1 if arm == "plain" else 2)
        s = tokens * seconds_per_token[arm]
        clock = SimpleNamespace(step_s=lambda s=s: s, wall=lambda phase: 0.0)
        ctl._learn_rate(plan, [None] * len(ids), [[0] * (tokens // len(ids))] * len(ids), clock)
        chosen.append(arm)
    return chosen


def test_auto_converges_to_the_drafter_that_measures_faster_not_the_one_predicted():
    """The model predicts self faster; eagle's steps measure 1.5x faster: auto ends up on eagle (a controller that
    considers only its first drafter, or lets the prediction decide, stays on self)."""
    ctl, res, spec_res = two_drafters()
    ctl.choose(list(range(8)), {"self": [4] * 8, "eagle": [4] * 8}, res, spec_res)
    assert ctl.arm_rates["self"] > ctl.arm_rates["eagle"] > ctl.arm_rates["plain"]  # the model's ranking
    ctl.measured = MeasuredArms()
    chosen = drive(ctl, res, spec_res, {"plain": 2e-3, "self": 1.5e-3, "eagle": 1e-3}, 400)
    assert chosen[-100:].count("eagle") >= 95, chosen[-100:]
    assert {"self", "eagle", "plain"} <= set(chosen[:64])  # each arm was tried in the warm-up
    st = ctl.stats()
    assert st["auto_chosen"] == "eagle" and st["auto_current_by_bucket"] == {"8": "eagle"}
    rates = st["auto_measured_rates"]
    assert abs(rates["eagle@8"] - 1000) < 1 and abs(rates["self@8"] - 1000 / 1.5) < 1 and rates["plain@8"] < 600
    assert st["auto_exploration_share"] <= 0.05


def test_plain_measured_faster_wins_over_speculation_predicted_faster():
    """The cost model never overrides a measured comparison: speculation predicted ahead, plain measured ahead."""
    ctl, res, spec_res = two_drafters()
    chosen = drive(ctl, res, spec_res, {"plain": 1e-3, "self": 2e-3, "eagle": 2e-3}, 300)
    assert ctl.arm_rates["self"] > ctl.arm_rates["plain"]
    assert chosen[-100:].count("plain") >= 95


def test_exploration_stays_within_five_percent_after_the_first_64_steps():
    """Near a tie the close arm is re-measured now and then, and a batch bucket met soon after the warm-up waits
    for the budget: at every step, exploration after the first 64 steps is at most 5% of them."""
    ctl, res, spec_res = two_drafters()
    m = ctl.measured
    times = {"plain": 2e-3, "self": 1.1e-3, "eagle": 1e-3}
    drive(ctl, res, spec_res, times, 70)
    shares = []
    for ids in (list(range(100, 132)), list(range(8))):  # a new batch bucket, then back
        for _ in range(700):
            drive(ctl, res, spec_res, times, 1, ids=ids)
            shares.append(m.explored / max(1, m.steps - m.WARMUP))
    assert max(shares) <= 0.05 and m.explored > 0
    assert m.rate("self", 32) is not None and m.rate("plain", 32) is not None  # measured there, in time


def test_when_the_exploited_arm_drifts_the_others_are_measured_again():
    """Eagle's rate falls by 30% (still above what self measured long ago); self has meanwhile become faster:
    the drift flags the other arms' measurements as old, self is measured again and auto moves to it."""
    ctl, res, spec_res = two_drafters()
    times = {"plain": 2e-3, "self": 2e-3, "eagle": 1e-3}
    drive(ctl, res, spec_res, times, 300)
    assert ctl.measured.current[8] == "eagle"
    times.update(eagle=1 / 700, self=1e-3)
    after = drive(ctl, res, spec_res, times, 400)
    assert after[-100:].count("self") >= 95, after[-100:]


def test_a_batch_bucket_not_measured_yet_is_explored_and_starts_from_the_nearest_one():
    """At a new batch bucket the best arm measured at the nearest bucket is exploited first ("measured-near"), the
    arms are measured there (within the budget), and the choice follows what they measure there."""
    ctl, res, spec_res = two_drafters()
    drive(ctl, res, spec_res, {"plain": 2e-3, "self": 1.5e-3, "eagle": 1e-3}, 400)
    wide = list(range(100, 132))
    reasons = []
    orig = ctl.measured.pick

    def pick(arms, B):
        p = orig(arms, B)
        reasons.append(p.reason)
        return p
    ctl.measured.pick = pick
    chosen = drive(ctl, res, spec_res, {"plain": 2e-3, "self": 0.5e-3, "eagle": 1e-3}, 1200, ids=wide)
    assert reasons[0] == "measured-near" and chosen[0] == "eagle"
    assert "explore" in reasons and ctl.measured.rate("self", 32) is not None
    assert chosen[-100:].count("self") >= 95
    m = ctl.measured
    assert m.explored <= 0.05 * (m.steps - m.WARMUP)


def test_the_cost_model_prunes_arms_predicted_far_behind_and_orders_the_trials():
    m = MeasuredArms()
    arms = [Arm("plain", 100.0, 100.0), Arm("a", 300.0, 320.0), Arm("d", 200.0, 240.0), Arm("b", 250.0, 290.0),
            Arm("c", 50.0, 60.0)]
    measures = {"plain": 100.0, "a": 300.0, "b": 250.0, "c": 50.0, "d": 200.0}  # tokens/s each arm realizes
    picks = []
    for step in range(60):
        picks.append(m.pick(arms, 8).arm)
        m.record(picks[-1], 8, measures[picks[-1]] * 0.01, 0.01, step)
    assert picks[:4] == ["a"] * 4  # nothing measured: the model's best, measured first
    assert "c" not in picks and "plain" in picks  # predicted far behind: never tried (but plain always is)
    assert picks.index("plain") < picks.index("b") < picks.index("d")  # plain (the baseline) first, then the model's order
    assert picks[-5:] == ["a"] * 5 and m.rate("b", 8) == 250.0
    assert m.second_trials == 2  # b and d, behind a within SECOND: each tried again once (plain, 0.33x, is not)


def test_what_was_measured_is_remembered_by_the_next_controller():
    ctl, res, spec_res = two_drafters()
    drive(ctl, res, spec_res, {"plain": 2e-3, "self": 1.5e-3, "eagle": 1e-3}, 200)
    fresh, _, _ = two_drafters()
    fresh.measured.warm(ctl.measured.state())
    fresh.choose(list(range(8)), {"self": [4] * 8, "eagle": [4] * 8}, res, spec_res)
    # its first step already exploits the remembered best (arms remembered on too few steps are still tried)
    assert fresh.measured.current[8].split("-g")[0] == "eagle" and fresh.measured.steps == 1
    assert fresh.measured.rate(fresh.measured.current[8], 8) == pytest.approx(1000)


def test_the_choice_its_exploration_and_the_measured_rates_reach_llm_stats(tiny_ckpt):
    path = tiny_ckpt("mixtral")
    llm = auto_llm(path)
    ctl = controller_of(llm)
    ps, sp = BATCHES["b7"]
    assert [o.token_ids for o in llm.generate(ps, sp)] == reference(path, "b7")
    st = llm.stats
    assert st["auto_chosen"] in st["auto_chosen_steps"]
    assert sum(st["auto_chosen_steps"].values()) == ctl.steps == st["decode_steps"]
    assert st["auto_measured_rates"] and all(v > 0 for v in st["auto_measured_rates"].values())
    assert 0.0 <= st["auto_exploration_share"] <= 1.0
    assert np.isfinite(list(st["auto_measured_rates"].values())).all()


def test_plans_and_feedback_price_a_verification_with_one_function(tiny_ckpt, monkeypatch):
    """`Controller.verify_raw` prices the plans' verifications and the feedback's refinement of what a step
    really drafted (no second derivation of the union and forward time in feedback.py)."""
    llm = auto_llm(tiny_ckpt("mixtral"), auto_memory=False)
    ctl = controller_of(llm)
    callers = []
    real = ctl.verify_raw

    def counted(*a, **k):
        import inspect
        callers.append(inspect.stack()[1].function)
        return real(*a, **k)
    monkeypatch.setattr(ctl, "verify_raw", counted)
    ctl.force = "spec"
    ps, sp = BATCHES["b7"]
    assert [o.token_ids for o in llm.generate(ps, sp)] == reference(tiny_ckpt("mixtral"), "b7")
    assert {"_costs", "_learn_time"} <= set(callers)


def test_with_trees_each_drafter_has_a_tree_arm_that_wins_when_it_measures_faster():
    """decoding="auto" over a decoder that verifies trees (draft_tree): chain and tree arms are both offered
    ("eagle" and "eagle/tree"), and the choice follows the one that measures faster; a tree arm's plan carries the
    decoder's width, a chain arm's width 1."""
    ctl, res, spec_res = two_drafters()
    ctl.use(["self", "eagle"], width=3)
    ctl.choose(list(range(8)), {"self": [4] * 8, "eagle": [4] * 8}, res, spec_res)
    assert {"self/tree", "eagle/tree"} <= set(ctl.arm_rates), ctl.arm_rates
    speeds = {"plain": 2e-3, "self": 1.5e-3, "eagle": 1e-3, "self/tree": 1.4e-3, "eagle/tree": 0.5e-3}
    widths = []
    orig = ctl._spec_plan

    def spy(*a, **k):
        p = orig(*a, **k)
        widths.append((p.arm, p.width))
        return p
    ctl._spec_plan = spy
    chosen = drive(ctl, res, spec_res, speeds, 600)
    assert chosen[-100:].count("eagle/tree") >= 95
    assert all(w == (3 if arm.endswith("/tree") else 1) for arm, w in widths) and {w for _, w in widths} == {1, 3}


@pytest.mark.parametrize("arm, branched", [("self/tree", True), ("self-g4", False)])
def test_a_tree_arm_drafts_trees_and_a_chain_arm_chains_both_exact(tiny_ckpt, monkeypatch, arm, branched):
    """Real runs with every step on one arm: the tree arm's steps verify branching trees, the chain arm's steps
    verify chains (under the same tree-width decoder), and both give plain greedy's tokens."""
    from specmoe.decoding.control.measured import MeasuredArms, Pick
    from specmoe.decoding.strategies.speculative import SpeculativeDecoder
    path = tiny_ckpt("mixtral")
    seen = {}
    real_init = SpeculativeDecoder.__init__

    def init(self, *a, **kw):
        real_init(self, *a, **kw)
        seen["dec"] = self
    monkeypatch.setattr(SpeculativeDecoder, "__init__", init)
    real_pick = MeasuredArms.pick

    def pick(self, arms, B):
        real_pick(self, arms, B)
        names = [a.name for a in arms]
        return Pick(arm if arm in names else names[0], "explore")
    monkeypatch.setattr(MeasuredArms, "pick", pick)
    llm = auto_llm(path, draft_tree=True, auto_memory=False)
    ps, sp = BATCHES["b7"]
    assert [o.token_ids for o in llm.generate(ps, sp)] == reference(path, "b7")
    dec = seen["dec"]
    assert dec.tally.steps > 0 and (dec.branched > 0) == branched


def test_an_arm_far_behind_at_a_neighbouring_bucket_is_not_tried_at_a_new_one():
    """At batch 8 "self" measures at half eagle's rate; at batch 16 (a new bucket) it is not tried, while plain
    (the baseline) and eagle are measured there."""
    ctl, res, spec_res = two_drafters()
    speeds = {"plain": 2e-3, "self": 2e-3, "eagle": 1e-3, "self-g2": 2e-3, "eagle-g2": 1.1e-3}
    drive(ctl, res, spec_res, speeds, 300)
    m = ctl.measured
    assert m.score("self", 8) is not None and m.score("self", 8) < m.NEAR * m.score("eagle", 8)
    drive(ctl, res, spec_res, speeds, m.NEAR_AFTER - 10, ids=list(range(100, 116)))
    assert m.n("self", 16) == 0 and m.n("plain", 16) >= m.min_steps
    drive(ctl, res, spec_res, speeds, 300, ids=list(range(100, 116)))  # settled there: checked after all
    assert m.n("self", 16) >= m.min_steps


def _exploit(m: MeasuredArms, arm: str, steps) -> None:
    """Record `steps` [(tokens, seconds)] of `arm` at batch 1 as the exploited arm."""
    m.current[1] = arm
    for t, s in steps:
        m.record(arm, 1, t, s, m.steps)
        m.steps += 1


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
    _exploit(m, "eagle", noisy)
    assert m.n("eagle", 1) == m.WINDOW and not m.stale  # (16 steps at 300, then 16 at 200: within the noise)
    assert m.drifts == 0
    for k in range(32):
        _exploit(m, "eagle", [(1.0, 0.01)])
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
    _exploit(m, "eagle", [(2.0, 0.01)] * 16)
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


def test_a_trial_step_is_charged_the_planning_its_arm_would_pay_once_chosen():
    """A trial (explore) plans afresh on every step; once chosen, a fixed configuration plans once per reused call
    (coast_max steps) and a per-row plan once per coast_steps: a trial step is charged that share of its plan, an
    exploited step its own."""
    ctl, _, _ = two_drafters()
    walls = {"plan": 0.0032, "setup": 0.0}
    clock = SimpleNamespace(step_s=lambda: 0.01, wall=lambda phase: walls.get(phase, 0.0))
    for arm, reason, share in (("eagle-g2", "explore", 1 / ctl.coast_max), ("eagle", "explore", 1 / ctl.coast_steps),
                               ("self-g2", "measured", 1.0)):
        plan = SimpleNamespace(kind="spec", reason=reason, arm=arm, width=1)
        ctl.measured.interrupt()
        for _ in range(2):  # (the first step after a switch is not measured)
            ctl._learn_rate(plan, [None] * 8, [[0, 0]] * 8, clock)
        tokens, seconds, _ = ctl.measured.win[(arm, 8)][-1]
        assert seconds == pytest.approx(0.01 + 0.0032 * share)


def test_a_drift_re_measures_the_arms_within_reach_not_those_far_behind():
    m = MeasuredArms()
    for arm, rate in (("plain", 70.0), ("self-g2", 120.0), ("eagle-g4", 180.0)):
        m.interrupt()
        for _ in range(m.min_steps + 1):
            m.record(arm, 1, 1.0, 1 / rate, 0)
    m.interrupt()
    _exploit(m, "eagle-g2", [(2.0, 0.01)] * 17 + [(2.0, 0.015)] * 16)  # 200 tok/s, then 133 (the first: a switch)
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


def test_by_default_the_arms_are_the_fixed_configurations_plain_and_the_mixes():
    """`auto` chooses among plain, each drafter × draft length (chains; trees with draft_tree), and the mixes with
    a lookup drafter; a drafter's per-row lengths ("self", priced by the cost model) are offered only with
    `PER_ROW` (pinned at batch 1 and 64 they ran at 0.89x and 0.91x the fixed eagle-g2, drafting deeper for the
    same tokens, while measured on pooled acceptance they took batch 64)."""
    from specmoe.decoding.control.measured import Pick
    ctl, res, spec_res = two_drafters()
    offered = []

    def pick(arms, B):
        offered.append({a.name for a in arms})
        return Pick("plain", "measured")
    ctl.measured.pick = pick
    del ctl.PER_ROW  # the class default
    ctl.choose(list(range(8)), {"self": [4] * 8, "eagle": [4] * 8}, res, spec_res)
    ctl.PER_ROW = True
    ctl.choose(list(range(8)), {"self": [4] * 8, "eagle": [4] * 8}, res, spec_res)
    assert offered[0] == {"plain", "self-g2", "self-g4", "eagle-g2", "eagle-g4"}
    assert offered[1] == offered[0] | {"self", "eagle"}


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
    _exploit(m, "eagle-g4", [(3.0, 3.0 / 240)] * 20)
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
    _exploit(m, "eagle-g4", [(3.0, 3.0 / 260)] * 20)
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
