"""Cost-aware selection over draft trees (`draft_selection="cost"` with `draft_tree=True`, SpecFit).

Per step, the verified set of each sequence is an ancestor-closed subtree of its proposed tree, chosen to
maximise (B + Σ_v P(v)) / T(S) over the whole batch: P(v) = Π p(u) along v's path (`selection.path_probs`),
p(u) the acceptance measured so far for nodes at u's depth and sibling rank (rank 0: the first child, i.e.
the drafter's chain; Beta(1, 1) prior, conditional on the parent's acceptance). The verification forward is
padded to the largest tree of the batch, so T(S) = a + c · B · (1 + max_b |S_b|), fitted against the rows
the forward computed (`ChainSelector`'s least-squares fit; every 8th step verifies whole trees so the fit
keeps seeing large verifications). Candidates: for every cap k, each sequence's k nodes of highest P
(ancestor-closed: P never grows along a path), and `selection.select`'s SpecFit greedy set; the best by the
objective wins. For every k the capped set's Σ P is at least that of the first k nodes of the chain, so the
choice never scores lower than a chain selection of the same budget; chains are the special case of one
child per node. Lossless: it only removes nodes.
"""
from __future__ import annotations

from specmoe.decoding.chainselect import ChainSelector
from specmoe.decoding.selection import DraftNode, VerifyCost, path_probs, select
from specmoe.decoding.tree import DraftTree


def ranks(tree: DraftTree) -> list[int]:
    """Each node's index among its siblings (children in order)."""
    seen: dict[int, int] = {}
    out = []
    for p in tree.parents:
        out.append(seen.get(p, 0))
        seen[p] = out[-1] + 1
    return out


class TreeSelector(ChainSelector):
    def __init__(self, gamma: int, width: int, *, forget: float = 0.98):
        super().__init__(gamma, forget=forget)
        self.width = width
        self.t_reach = [[0.0] * width for _ in range(gamma)]  # [depth-1][rank]: verified with parent accepted
        self.t_acc = [[0.0] * width for _ in range(gamma)]    # ... and accepted

    def _key(self, depth: int, rank: int) -> tuple[int, int]:
        return min(depth, len(self.t_reach)) - 1, min(rank, self.width - 1)

    def prob(self, depth: int, rank: int) -> float:
        d, k = self._key(depth, rank)
        return (self.t_acc[d][k] + 1.0) / (self.t_reach[d][k] + 2.0)

    def nodes_of(self, trees: list[DraftTree]) -> tuple[list[DraftNode], list[tuple[int, int]]]:
        """The batch's forest as `DraftNode`s (P from the measured acceptance) and each node's (row, index)."""
        nodes, where = [], []
        for b, t in enumerate(trees):
            base = len(nodes)
            for i, (p, d, k) in enumerate(zip(t.parents, t.depths(), ranks(t))):
                nodes.append(DraftNode(seq=b, parent=base + p if p >= 0 else -1, p=self.prob(d, k)))
                where.append((b, i))
        return nodes, where

    def choose_trees(self, trees: list[DraftTree]) -> list[DraftTree]:
        """The subtree of each proposal to verify this step."""
        fit = self.cost()
        self.calls += 1
        if fit is None or not any(len(t) for t in trees) or self.calls % self.EXPLORE_EVERY == 0:
            return trees
        nodes, where = self.nodes_of(trees)
        keep = [[where[i][1] for i in S] for S in self.select_sets(nodes, len(trees), fit)]
        self.cut += len(nodes) - sum(len(k) for k in keep)
        return [t.restrict(k) for t, k in zip(trees, keep)]

    @staticmethod
    def padded_objective(P: list[float], sets: list[list[int]], fit: tuple[float, float]) -> float:
        a, c = fit
        B = len(sets)
        return (B + sum(P[i] for S in sets for i in S)) / (a + c * B * (1 + max((len(S) for S in sets), default=0)))

    @classmethod
    def select_sets(cls, nodes: list[DraftNode], B: int, fit: tuple[float, float]) -> list[list[int]]:
        """Per sequence, the node indices (into `nodes`) to verify, by the padded objective."""
        P = path_probs(nodes)
        order: list[list[int]] = [[] for _ in range(B)]
        for i in sorted(range(len(nodes)), key=lambda i: (-P[i], i)):  # a parent before its children
            order[nodes[i].seq].append(i)
        cands = [[o[:k] for o in order] for k in range(max(len(o) for o in order) + 1)]
        a, c = fit
        spec = select(nodes, B, VerifyCost(base_s=max(a + c * B, 1e-9), token_s=c * B))  # SpecFit greedy
        cands.append([[i for i in spec if nodes[i].seq == b] for b in range(B)])
        return max(cands, key=lambda sets: (cls.padded_objective(P, sets, fit), -sum(map(len, sets))))

    def record_trees(self, trees: list[DraftTree], paths: list[list[int]], positions: int, seconds: float) -> None:
        """One step: trees verified, paths[b] the accepted forward rows (root 0 first), the forward covered
        `positions` rows in `seconds`."""
        for t, path in zip(trees, paths):
            on = set(path)
            for i, (p, d, k) in enumerate(zip(t.parents, t.depths(), ranks(t))):
                if p + 1 in on:
                    dd, kk = self._key(d, k)
                    self.t_reach[dd][kk] += 1
                    self.t_acc[dd][kk] += (i + 1) in on
        f = self.forget
        self.n, self.sx, self.sy = f * self.n + 1, f * self.sx + positions, f * self.sy + seconds
        self.sxx, self.sxy = f * self.sxx + positions * positions, f * self.sxy + positions * seconds
        self.steps += 1

    def stats(self) -> dict:
        st = super().stats()
        st["selection_accept_probs"] = [[(a + 1.0) / (r + 2.0) for a, r in zip(ra, rr)]
                                        for ra, rr in zip(self.t_acc, self.t_reach)]
        return st
