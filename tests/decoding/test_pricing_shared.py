"""One pricing of the expert union (issue 37): the tree selection (`trees.selection` / `TreeSelector`) and the
auto controller's cost model (`CostModel.expected_union`, hence `Controller.plan`) both take a verification's
expected expert union from `decoding.expert_union.union_hit`, and price the same union alike."""
from __future__ import annotations

import inspect

import numpy as np
import pytest

from specmoe.decoding import expert_union
from specmoe.decoding.trees.selection import DraftNode, absorb, missing
from specmoe.decoding.trees.treeselect import TreeSelector

from tests.decoding.test_controller import synthetic


def record_callers(monkeypatch) -> list[str]:
    """Wrap the shared function; the returned list gets the module name of each caller."""
    real, callers = expert_union.union_hit, []

    def spy(*args, **kw):
        callers.append(inspect.currentframe().f_back.f_globals["__name__"])
        return real(*args, **kw)
    monkeypatch.setattr(expert_union, "union_hit", spy)
    return callers


def tiny_forest() -> list[DraftNode]:
    """Two sequences, a chain and a two-child tree; known picks and a shared frequency mapping."""
    freq = {(0, e): 0.25 for e in range(4)} | {(1, e): 0.5 for e in range(2)}
    return [DraftNode(0, -1, 0.9, frozenset({(0, 0), (1, 0)})), DraftNode(0, 0, 0.7, freq),
            DraftNode(1, -1, 0.8, freq), DraftNode(1, -1, 0.3, frozenset({(0, 5)})), DraftNode(1, 2, 0.6, freq)]


def test_tree_selection_and_controller_plan_both_price_the_union_with_the_shared_function(monkeypatch):
    callers = record_callers(monkeypatch)
    sets = TreeSelector.select_sets(tiny_forest(), 2, (1e-3, 1e-4, 5e-3), covered=frozenset({(0, 1)}))
    assert sets and "specmoe.decoding.trees.selection" in callers, callers
    tree_calls = len(callers)

    ctl, res, spec_res = synthetic(read_s=20e-3)
    ctl.acc.record(list(range(4)), [4] * 4, [3] * 4, [[0.9] * 4] * 4)
    ctl.measured.min_steps = 0
    plan = ctl.plan(list(range(4)), [4] * 4, res, spec_res)
    assert plan.kind in ("spec", "plain")
    assert "specmoe.decoding.control.costmodel" in callers[tree_calls:], callers[tree_calls:]


def test_both_pricings_give_the_same_union():
    """n nodes routing by the layer frequencies add, in the tree selection's sparse form, the union the cost model
    expects for n independent tokens (nothing resident, no refinement)."""
    ctl, res, _ = synthetic(read_s=1e-3)
    cm = ctl.cost
    rng = np.random.default_rng(0)
    p = rng.random(cm.routing.p.shape) * 0.4
    cm.routing.p = p
    freq = {(layer, e): float(p[layer, e]) for layer in range(p.shape[0]) for e in range(p.shape[1])}
    resident = np.zeros_like(res)
    resident[0, :3] = True
    for n in (1, 3, 8):
        union, miss = cm.expected_union(np.array([n]), resident, "plain")
        assert abs(absorb(freq, missing(), n) - union.sum()) < 1e-9
        covered = {(0, e) for e in range(3)}
        assert abs(absorb(freq, missing(covered), n) - miss.sum()) < 1e-9


def test_a_tree_step_records_each_node_by_depth_and_rank():
    """The node table: a node counts as reached when its parent was accepted, as a hit when it was accepted too."""
    from specmoe.decoding.control.learning import Acceptance
    from specmoe.decoding.trees.tree import trie
    a = Acceptance(3, decay=0.0)
    t = trie([[1, 2, 3], [4, 5]])  # chain 1-2-3 (rank 0), sibling 4 (rank 1) with child 5
    a.record([0], [t.depth()], [2], [[]], [t], [[0, 1, 2]])  # accepted 1, 2; 3 rejected
    assert a.reach[:, 0].tolist() == [1, 1, 1] and a.hit[:, 0].tolist() == [1, 1, 0]
    assert a.reach[0, 1] == 1 and a.hit[0, 1] == 0  # node 4: reached (the root is always accepted), rejected
    assert a.reach[1, 0] + a.reach[1, 1] == 1  # node 5's parent was rejected: not reached


def test_the_selector_and_the_controller_price_with_one_acceptance_estimate_recorded_once(tiny_ckpt, monkeypatch):
    """auto with cost-aware tree selection: the selector's node probabilities come from the controller's own
    `Acceptance` objects (the same objects), and each speculative step records into them once."""
    from specmoe import SamplingParams
    from specmoe.decoding.control.learning import Acceptance
    from specmoe.decoding.strategies.speculative import SpeculativeDecoder
    from specmoe.engine.auto import controller_of
    from tests.decoding.test_controller import auto_llm
    seen, records = {}, []
    real_init, real_record = SpeculativeDecoder.__init__, Acceptance.record

    def init(self, *a, **kw):
        real_init(self, *a, **kw)
        seen["dec"] = self

    def record(self, *a, **kw):
        records.append(self)
        return real_record(self, *a, **kw)
    monkeypatch.setattr(SpeculativeDecoder, "__init__", init)
    monkeypatch.setattr(Acceptance, "record", record)
    llm = auto_llm(tiny_ckpt("mixtral"), draft_tree=True, draft_selection="cost")
    ctl = controller_of(llm)
    ctl.force = "spec"
    llm.generate([[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 11, 9, 10]], SamplingParams(max_tokens=16, temperature=0.0))
    dec = seen["dec"]
    assert dec.selector is not None and dec.selector.accs is ctl.acceptance() is dec.accs
    steps = dec.tally.steps
    assert steps > 0 and dec.branched > 0, "the run must have verified branching trees"
    per_step = {}
    for a in records:
        per_step[id(a)] = per_step.get(id(a), 0) + 1
    assert sum(per_step.values()) <= steps * len(ctl.acceptance()), "recorded more than once per drafter and step"
    first = ctl.acceptance()[dec.default]
    assert first.reach[:, 1:].sum() > 0, "tree siblings recorded by rank"
    assert dec.selector.prob(1, 0, dec.default) == first.node_prob(1, 0) != first.prior


def test_under_auto_the_selection_prices_the_verification_with_the_controllers_cost_model(monkeypatch):
    """The selector attached with the controller's cost model takes its time line from `CostModel.verify_line`
    (no fit of its own), and that line is the controller's `forward_time` of an unpadded verification without reads."""
    from specmoe.decoding.trees.tree import chain
    ctl, res, _ = synthetic(read_s=0.0)
    cm = ctl.cost_model()
    calls = []
    real = type(cm).verify_line

    def spy(self, B, *a):
        calls.append(B)
        return real(self, B, *a)
    monkeypatch.setattr(type(cm), "verify_line", spy)

    class Runner:  # what attach reads: a store that holds every expert (no expert term), no observers
        class provider:
            holds_all = True
        observers: list = []
    sel = TreeSelector(4, 1, experts=False)
    sel.attach(Runner(), None, cm)
    assert sel.cost() is None  # nothing fitted ...
    sel.choose_trees([chain([1, 2, 3]), chain([4, 5])])
    assert calls == [2] and sel.stats()["selection_time_source"] == "cost model"  # ... the model priced it
    a, c = real(cm, 3)
    none = np.zeros_like(cm.routing.p, dtype=bool)
    for rows in (3, 9):
        union, _ = cm.expected_union(np.array([3]), none, "spec")
        t = cm.forward_time(np.array([rows]), union, np.zeros_like(union))[0] * cm.ratio(cm.fwd(3), 6)
        assert a + c * rows == pytest.approx(t, rel=1e-9)


def test_a_tree_arm_gains_what_a_sibling_saves_where_the_chain_is_rejected():
    """Worked out: chain nodes accepted half the time given their parent, rank-1 siblings 40%; a 2-deep row of
    width 2 gains P(reach 1)·(1 − .5)·.4 + P(reach 2)·(1 − .5)·.4 = .2 + .1 over its chain; width 1 gains nothing."""
    from specmoe.decoding.control.candidates import tree_extra
    from specmoe.decoding.control.learning import Acceptance
    a = Acceptance(3, decay=0.0)
    a.reach[:, :2] = 1e9
    a.hit[:, 0], a.hit[:, 1] = 0.5e9, 0.4e9
    assert tree_extra(a, np.array([2]), 2) == pytest.approx(0.3, rel=1e-6)
    assert tree_extra(a, np.array([2, 0, 1]), 2) == pytest.approx(0.5, rel=1e-6)
    assert tree_extra(a, np.array([3]), 1) == 0.0
