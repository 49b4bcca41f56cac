"""Cost-aware selection of the draft positions to verify (SpecFit / EcoSpec), as pure functions.

A step's drafts form a forest: for every sequence b a tree whose root is b's pending token (always
verified) and whose nodes are drafted tokens. Verifying a node v pays off with probability
P(v) = Π p(u) over v's path (p(u): the probability that u is accepted given its parent was). The
verified set S must be ancestor-closed (a node is only useful if its parent is accepted). A step emits
B + Σ_{v∈S} P(v) tokens in expectation (every sequence emits its correction/bonus token) and costs

    T(S) = base_s + token_s·|S| + expert_s·|experts(S) \\ covered|

where experts(v) are the (layer, expert) pairs the target's routers pick for v (EcoSpec's expert
buffer: an expert already resident, or already needed by the pending tokens or by another selected node,
costs nothing more) and `covered` holds the resident and pending-token experts. Where a node's picks are
not known (a lookup draft, a tree leaf the draft never forwarded) `experts(v)` may be a mapping
(layer, expert) → probability that v routes there (e.g. the layer's recent routing frequency); the count
is then an expectation: with m(k) = P(pair k not yet in the union) (0 for covered pairs, multiplied by
1 − p(k) for every selected node, independence assumed), node v adds Σ_k p_v(k)·m(k) pairs in
expectation. A set of pairs is the special case p = 1. Selection maximises
(B + ΣP)/T: greedily add the frontier node with the best P(v)/ΔT(v), remember the best prefix. Chains
are the special case of one child per node. The result is never worse (by the objective) than the
chain-restricted greedy selection nor than any uniform draft length, which are evaluated as candidates.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from specmoe.decoding import expert_union


@dataclass(frozen=True)
class DraftNode:
    seq: int  # the sequence (batch row) whose tree holds this node
    parent: int  # index of the parent node in the node list; -1: the sequence's pending token
    p: float  # P(accepted | parent accepted), in [0, 1]
    # (layer, expert) pairs the target needs for it: a set (known picks) or a mapping pair → probability
    experts: frozenset | Mapping = field(default_factory=frozenset)


@dataclass(frozen=True)
class VerifyCost:
    """Predicted verification time: base_s (the B pending tokens and their experts), token_s per extra
    verified position, expert_s per (layer, expert) pair added to the union beyond `covered`."""
    base_s: float
    token_s: float
    expert_s: float = 0.0


def path_probs(nodes: list[DraftNode]) -> list[float]:
    """P(v) for every node (parents must come before children)."""
    P: list[float] = []
    for i, v in enumerate(nodes):
        if v.parent >= i:
            raise ValueError(f"node {i}: parent {v.parent} must come before its child")
        P.append(v.p * (1.0 if v.parent < 0 else P[v.parent]))
    return P


def _pairs(experts):
    return experts.items() if isinstance(experts, Mapping) else ((k, 1.0) for k in experts)


def missing(covered=frozenset()) -> dict:
    """m(k) = P(pair k is not in the union yet) for the pairs `covered` names (a set: certainly in, a mapping:
    in with that probability); pairs absent from the result have m = 1."""
    return {k: 1.0 - p for k, p in _pairs(covered)}


def added(experts, miss: dict) -> float:
    """Expected (layer, expert) pairs `experts` adds to the union beyond `miss` (see the module docstring): one node,
    `expert_union.union_hit` at n = 1 in its closed form p·m (not re-routed: the last bit could break greedy ties)."""
    return sum(p * miss.get(k, 1.0) for k, p in _pairs(experts))


def absorb(experts, miss: dict, times: int = 1) -> float:
    """Add `times` nodes with these experts to the union (`miss` updated in place); the expected new pairs
    (`expert_union.union_hit`, the formula the auto controller's cost model prices with)."""
    new = 0.0
    for k, p in _pairs(experts):
        gained, miss[k] = expert_union.union_hit(p, times, miss.get(k, 1.0))
        new += gained
    return new


def union_added(expert_sets, miss: dict) -> float:
    """Expected pairs a collection of nodes' experts adds together (nodes sharing one experts object, e.g. a
    lookup drafter's routing frequency, are absorbed at once). `miss` is updated in place."""
    groups: dict[int, list] = {}
    for ex in expert_sets:
        g = groups.setdefault(id(ex), [ex, 0])
        g[1] += 1
    return sum(absorb(ex, miss, n) for ex, n in groups.values())


def objective(nodes: list[DraftNode], S, B: int, cost: VerifyCost, covered=frozenset()) -> float:
    """(B + Σ_{v∈S} P(v)) / T(S): expected tokens per second of verifying S."""
    P = path_probs(nodes)
    extra = union_added([nodes[i].experts for i in S], missing(covered)) if cost.expert_s else 0.0
    return (B + sum(P[i] for i in S)) / (cost.base_s + cost.token_s * len(S) + cost.expert_s * extra)


def is_ancestor_closed(nodes: list[DraftNode], S) -> bool:
    S = set(S)
    return all(nodes[i].parent < 0 or nodes[i].parent in S for i in S)


def _greedy(nodes, P, B, cost, miss0, budget, allowed) -> list[int]:
    """Best prefix of the greedy order by P(v)/ΔT(v) over the frontier, restricted to `allowed`; `miss0`:
    `missing(covered)`."""
    children: dict[int, list[int]] = {}
    for i, v in enumerate(nodes):
        if i in allowed:
            children.setdefault(v.parent, []).append(i)
    frontier = set(children.get(-1, []))
    miss, chosen = dict(miss0), []
    gain, t = float(B), cost.base_s
    best, best_n = gain / t, 0
    while frontier and len(chosen) < budget:
        memo: dict[int, float] = {}  # expected new pairs per experts object (shared objects scored once)

        def dt(i):
            ex = nodes[i].experts
            if not cost.expert_s:
                return cost.token_s
            if id(ex) not in memo:
                memo[id(ex)] = added(ex, miss)
            return cost.token_s + cost.expert_s * memo[id(ex)]

        def score(i):
            d = dt(i)
            return (P[i] / d if d > 0 else float("inf"), -i)
        i = max(frontier, key=score)
        frontier.remove(i)
        t += dt(i)
        if cost.expert_s:
            absorb(nodes[i].experts, miss)
        gain += P[i]
        chosen.append(i)
        frontier.update(children.get(i, []))
        if gain / t > best:
            best, best_n = gain / t, len(chosen)
    return chosen[:best_n]


def chain_nodes(nodes: list[DraftNode]) -> set[int]:
    """The top-1 chain of every tree: from each root, the most probable child at each depth."""
    best_child: dict[tuple[int, int], int] = {}
    for i, v in enumerate(nodes):
        key = (v.seq, v.parent)
        if key not in best_child or v.p > nodes[best_child[key]].p:
            best_child[key] = i
    chain, frontier = set(), [i for (s, par), i in best_child.items() if par == -1]
    while frontier:
        i = frontier.pop()
        chain.add(i)
        j = best_child.get((nodes[i].seq, i))
        if j is not None:
            frontier.append(j)
    return chain


def uniform_chains(nodes: list[DraftNode], budget: int) -> list[list[int]]:
    """For g = 1, 2, ...: every sequence verifies the first g nodes of its top-1 chain (fixed γ = g),
    while the total stays within budget."""
    chain = chain_nodes(nodes)
    depth: dict[int, int] = {}
    for i in sorted(chain):
        depth[i] = 1 + (depth[nodes[i].parent] if nodes[i].parent >= 0 else 0)
    out, g = [], 1
    while True:
        S = [i for i in sorted(chain) if depth[i] <= g]
        if len(S) > budget or (out and len(S) == len(out[-1])):
            return out
        out.append(S)
        g += 1


def select(nodes: list[DraftNode], B: int, cost: VerifyCost, *, covered=frozenset(), budget: int | None = None,
           ) -> list[int]:
    """The ancestor-closed set of node indices to verify (sorted), at most `budget` nodes."""
    budget = len(nodes) if budget is None else budget
    P = path_probs(nodes)
    miss = missing(covered)
    candidates = [_greedy(nodes, P, B, cost, miss, budget, set(range(len(nodes)))),
                  _greedy(nodes, P, B, cost, miss, budget, chain_nodes(nodes)), []]
    candidates += uniform_chains(nodes, budget)
    best = max(candidates, key=lambda S: (objective(nodes, S, B, cost, covered), -len(S)))
    return sorted(best)
