"""The expected union of experts a forward touches: the one formula both pricings of a verification use, the tree
selection's (`trees.selection`: per (layer, expert) pair, as nodes join the verified set) and the auto controller's
cost model (`control.costmodel.CostModel.expected_union`: per layer and expert, for forwards of n tokens).

A pair each of n independent tokens routes to with probability p, and not yet in the union with probability m,
joins it with probability m·(1 − (1 − p)^n) and stays out with probability m·(1 − p)^n."""
from __future__ import annotations


def union_hit(p, n, miss=1.0):
    """(new, left): the expected addition of a pair to the union, miss·(1 − (1 − p)^n), and the probability it is
    still not in the union afterwards, miss·(1 − p)^n, for n independent tokens routing there with probability p
    (floats, or numpy arrays broadcast against each other; miss = 1: the pair was certainly not in it)."""
    left = miss * (1.0 - p) ** n
    return miss - left, left
