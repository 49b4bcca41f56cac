"""One pricing of the expert union (issue 37): the tree selection (`trees.selection` / `TreeSelector`) and the
auto controller's cost model (`CostModel.expected_union`, hence `Controller.plan`) both take a verification's
expected expert union from `decoding.expert_union.union_hit`, and price the same union alike."""
from __future__ import annotations

import inspect

import numpy as np

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
