"""Cost-aware selection of the draft positions to verify (SpecFit / EcoSpec), as pure functions.

A step's drafts form a forest: for every sequence b a tree whose root is b's pending token (always
verified) and whose nodes are drafted tokens. Verifying a node v pays off with probability
P(v) = Π p(u) over v's path (p(u): the probability that u is accepted given its parent was). The
verified set S must be ancestor-closed (a node is only useful if its parent is accepted). A step emits
B + Σ_{v∈S} P(v) tokens in expectation (every sequence emits its correction/bonus token) and costs

    T(S) = base_s + token_s·|S| + expert_s·|experts(S) \\ covered|

where experts(v) are the (layer, expert) pairs the target's routers pick for v (EcoSpec's expert
buffer: an expert already resident, or already needed by the pending tokens or by another selected node,
costs nothing more) and `covered` holds the resident and pending-token experts. Selection maximises
(B + ΣP)/T: greedily add the frontier node with the best P(v)/ΔT(v), remember the best prefix. Chains
are the special case of one child per node. The result is never worse (by the objective) than the
chain-restricted greedy selection nor than any uniform draft length, which are evaluated as candidates.
"""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class DraftNode:
    seq: int  # the sequence (batch row) whose tree holds this node
    parent: int  # index of the parent node in the node list; -1: the sequence's pending token
    p: float  # P(accepted | parent accepted), in [0, 1]
    experts: frozenset = field(default_factory=frozenset)  # (layer, expert) pairs the target needs for it


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


def objective(nodes: list[DraftNode], S, B: int, cost: VerifyCost, covered=frozenset()) -> float:
    """(B + Σ_{v∈S} P(v)) / T(S): expected tokens per second of verifying S."""
    P = path_probs(nodes)
    extra = set().union(*(nodes[i].experts for i in S)) - set(covered) if S else set()
    return (B + sum(P[i] for i in S)) / (cost.base_s + cost.token_s * len(S) + cost.expert_s * len(extra))


def is_ancestor_closed(nodes: list[DraftNode], S) -> bool:
    S = set(S)
    return all(nodes[i].parent < 0 or nodes[i].parent in S for i in S)


def _greedy(nodes, P, B, cost, covered, budget, allowed) -> list[int]:
    """Best prefix of the greedy order by P(v)/ΔT(v) over the frontier, restricted to `allowed`."""
    children: dict[int, list[int]] = {}
    for i, v in enumerate(nodes):
        if i in allowed:
            children.setdefault(v.parent, []).append(i)
    frontier = set(children.get(-1, []))
    have, chosen = set(covered), []
    gain, t = float(B), cost.base_s
    best, best_n = gain / t, 0
    while frontier and len(chosen) < budget:
        def score(i):
            dt = cost.token_s + cost.expert_s * len(nodes[i].experts - have)
            return (P[i] / dt if dt > 0 else float("inf"), -i)
        i = max(frontier, key=score)
        frontier.remove(i)
        t += cost.token_s + cost.expert_s * len(nodes[i].experts - have)
        have |= nodes[i].experts
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
    covered = frozenset(covered)
    candidates = [_greedy(nodes, P, B, cost, covered, budget, set(range(len(nodes)))),
                  _greedy(nodes, P, B, cost, covered, budget, chain_nodes(nodes)), []]
    candidates += uniform_chains(nodes, budget)
    best = max(candidates, key=lambda S: (objective(nodes, S, B, cost, covered), -len(S)))
    return sorted(best)
