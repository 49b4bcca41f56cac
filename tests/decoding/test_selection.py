"""Cost-aware draft selection (SpecFit / EcoSpec) against exhaustive search on small forests."""
import itertools
import random

import pytest

from specmoe.decoding.trees.selection import (DraftNode, VerifyCost, chain_nodes, is_ancestor_closed, objective, select,
                                        uniform_chains)


def random_forest(rng, B, n, experts=0):
    nodes = []
    for i in range(n):
        seq = rng.randrange(B)
        parents = [-1] + [j for j, v in enumerate(nodes) if v.seq == seq]
        ex = frozenset((rng.randrange(3), rng.randrange(6)) for _ in range(rng.randint(0, experts)))
        nodes.append(DraftNode(seq=seq, parent=rng.choice(parents), p=rng.random(), experts=ex))
    return nodes


def exhaustive(nodes, B, cost, covered, budget):
    best = None
    for r in range(min(budget, len(nodes)) + 1):
        for S in itertools.combinations(range(len(nodes)), r):
            if is_ancestor_closed(nodes, S):
                o = objective(nodes, S, B, cost, covered)
                best = o if best is None else max(best, o)
    return best


@pytest.mark.parametrize("seed", range(30))
def test_uniform_cost_is_optimal_and_closed(seed):
    """Without expert costs every node costs the same and P falls along every path, so the best set of each
    size is the most probable nodes: the greedy prefix must reach the exhaustive optimum."""
    rng = random.Random(seed)
    B = rng.randint(1, 3)
    nodes = random_forest(rng, B, rng.randint(1, 9))
    cost = VerifyCost(base_s=rng.uniform(0.5, 2), token_s=rng.uniform(0.01, 0.5))
    budget = rng.randint(1, len(nodes))
    S = select(nodes, B, cost, budget=budget)
    assert is_ancestor_closed(nodes, S) and len(S) <= budget
    assert objective(nodes, S, B, cost) == pytest.approx(exhaustive(nodes, B, cost, frozenset(), budget))


@pytest.mark.parametrize("seed", range(30))
def test_expert_costs_never_worse_than_chains(seed):
    rng = random.Random(100 + seed)
    B = rng.randint(1, 3)
    nodes = random_forest(rng, B, rng.randint(1, 9), experts=4)
    cost = VerifyCost(base_s=1.0, token_s=rng.uniform(0.01, 0.2), expert_s=rng.uniform(0.01, 0.3))
    covered = frozenset((rng.randrange(3), rng.randrange(6)) for _ in range(4))
    budget = rng.randint(1, len(nodes))
    S = select(nodes, B, cost, covered=covered, budget=budget)
    assert is_ancestor_closed(nodes, S) and len(S) <= budget
    got = objective(nodes, S, B, cost, covered)
    chain = chain_nodes(nodes)
    for r in range(min(budget, len(chain)) + 1):  # every ancestor-closed subset of the chains within budget
        for C in itertools.combinations(sorted(chain), r):
            if is_ancestor_closed(nodes, C):
                assert got >= objective(nodes, C, B, cost, covered) - 1e-12
    for C in uniform_chains(nodes, budget):
        assert got >= objective(nodes, C, B, cost, covered) - 1e-12
    assert got <= exhaustive(nodes, B, cost, covered, budget) + 1e-12


def test_marginal_experts_decide_between_equal_probabilities():
    """EcoSpec: of two equally likely drafts, the one whose experts are already needed is verified."""
    nodes = [DraftNode(0, -1, 0.6, frozenset({(0, 1), (1, 2)})), DraftNode(1, -1, 0.6, frozenset({(0, 5), (1, 5)}))]
    cost = VerifyCost(base_s=1.0, token_s=0.05, expert_s=0.2)
    assert select(nodes, 2, cost, covered={(0, 1), (1, 2)}, budget=1) == [0]
    assert select(nodes, 2, cost, covered={(0, 5), (1, 5)}, budget=1) == [1]
    # when fetching costs more than the expected gain, nothing is drafted
    assert select(nodes, 2, VerifyCost(base_s=1.0, token_s=0.05, expert_s=5.0)) == []


def test_children_must_follow_parents():
    with pytest.raises(ValueError):
        select([DraftNode(0, 1, 0.5), DraftNode(0, -1, 0.5)], 1, VerifyCost(1.0, 0.1))
