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
        clock = SimpleNamespace(step_s=lambda s=s: s, wall=lambda phase: 0.0,
                                traffic=lambda: (0.0, 0))
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

    def pick(arms, B, young=False):
        p = orig(arms, B, young)
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

    def pick(self, arms, B, young=False):
        real_pick(self, arms, B, young)
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


def test_a_trial_step_is_charged_the_planning_its_arm_would_pay_once_chosen():
    """A trial (explore) plans afresh on every step; once chosen, a fixed configuration plans once per reused call
    (coast_max steps) and a per-row plan once per coast_steps: a trial step is charged that share of its plan, an
    exploited step its own."""
    ctl, _, _ = two_drafters()
    walls = {"plan": 0.0032, "setup": 0.0}
    clock = SimpleNamespace(step_s=lambda: 0.01, wall=lambda phase: walls.get(phase, 0.0),
                            traffic=lambda: (0.0, 0))
    for arm, reason, share in (("eagle-g2", "explore", 1 / ctl.coast_max), ("eagle", "explore", 1 / ctl.coast_steps),
                               ("self-g2", "measured", 1.0)):
        plan = SimpleNamespace(kind="spec", reason=reason, arm=arm, width=1)
        ctl.measured.interrupt()
        for _ in range(2):  # (the first step after a switch is not measured)
            ctl._learn_rate(plan, [None] * 8, [[0, 0]] * 8, clock)
        tokens, seconds = ctl.measured.win[(arm, 8)][-1][:2]
        assert seconds == pytest.approx(0.01 + 0.0032 * share)


def test_by_default_the_arms_are_the_fixed_configurations_plain_and_the_mixes():
    """`auto` chooses among plain, each drafter × draft length (chains; trees with draft_tree), and the mixes with
    a lookup drafter; a drafter's per-row lengths ("self", priced by the cost model) are offered only with
    `PER_ROW` (pinned at batch 1 and 64 they ran at 0.89x and 0.91x the fixed eagle-g2, drafting deeper for the
    same tokens, while measured on pooled acceptance they took batch 64)."""
    from specmoe.decoding.control.measured import Pick
    ctl, res, spec_res = two_drafters()
    offered = []

    def pick(arms, B, young=False):
        offered.append({a.name for a in arms})
        return Pick("plain", "measured")
    ctl.measured.pick = pick
    del ctl.PER_ROW  # the class default
    ctl.choose(list(range(8)), {"self": [4] * 8, "eagle": [4] * 8}, res, spec_res)
    ctl.PER_ROW = True
    ctl.choose(list(range(8)), {"self": [4] * 8, "eagle": [4] * 8}, res, spec_res)
    assert offered[0] == {"plain", "self-g2", "self-g4", "eagle-g2", "eagle-g4"}
    assert offered[1] == offered[0] | {"self", "eagle"}
