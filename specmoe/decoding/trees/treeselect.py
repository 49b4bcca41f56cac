"""Cost-aware selection over draft trees (`draft_selection="cost"`, SpecFit + EcoSpec; a chain is a tree of
width 1, so chains are selected by the same rule).

Per step, the verified set of each sequence is an ancestor-closed subtree of its proposed tree, chosen to
maximise (B + Σ_v P(v)) / T(S) over the whole batch: P(v) = Π p(u) along v's path (`selection.path_probs`),
p(u) the acceptance measured so far for nodes of u's drafter at u's depth and sibling rank (rank 0: the first
child, i.e. the drafter's chain; conditional on the parent's acceptance): `learning.Acceptance.node_prob`, the one
estimate `auto`'s controller plans with too, recorded once per step by the decoder. The verification forward is
padded to the largest tree of the batch, so T(S) = a + c · B · (1 + max_b |S_b|). Under `auto`, (a, c) is the
controller's cost model (`CostModel.verify_line`: the same coefficients and refinements its plans price a
verification with); otherwise it is fitted against the rows the forward computed (a least-squares fit
t ≈ a + c · rows, exponentially forgotten; while the fit has no spread, e.g. same-size trees at batch 1, every
other step verifies only the chains). Every 8th step verifies whole trees, so deep and sibling nodes keep being
measured (and the fit keeps seeing large verifications). Candidates: for every cap k, each sequence's k nodes of highest P
(ancestor-closed: P never grows along a path), and `selection.select`'s SpecFit greedy set; the best by the
objective wins. For every k the capped set's Σ P is at least that of the first k nodes of the chain, so the
choice never scores lower than a chain selection of the same budget; chains are the special case of one
child per node. Lossless: it only removes nodes.

Expert term (EcoSpec): T(S) also counts, per MoE layer, the experts the selected nodes add to the
verification's union beyond those resident in the store when the step starts and those the pending tokens
need: T(S) = a + c · B · (1 + max_b |S_b|) + r · new_experts(S) (`selection`'s expected union). A node's
experts are the target routers' picks in the draft forward where the drafter recorded them
(`DraftTree.experts`: the self draft's chain nodes); otherwise (lookup drafts, which run no forward before
verification; the self draft's never-forwarded leaves) an expectation: the node routes to expert e of
layer l with probability P_l(e), the share of recent target tokens routed there (exponentially forgotten
counts seen by this selector's observer), so it adds Σ_e P_l(e) · P(e not yet in the union) experts per
layer. r = seconds per expert read: the calibrated cost model's `read_s` when the engine has one, else
measured here (the seconds the verification waited for loads per expert it fetched, forgotten like the fit);
(a, c) are fitted against the verification time minus that wait. The expectation assumes independent
tokens, which overcounts (tokens of one sequence route alike); r is scaled by the measured / predicted
fetches of recent verifications (`union_scale`, as the cost model refines its misses). Every candidate
(capped sets, the greedy by P(v)/ΔT(v) with its best prefix, every uniform chain prefix) is scored with the
expert term.
"""
from __future__ import annotations

import time

from specmoe.decoding.control.learning import Acceptance
from specmoe.decoding.trees.selection import (DraftNode, VerifyCost, missing, path_probs, select, uniform_chains,
                                        union_added)
from specmoe.decoding.trees.tree import DraftTree


def ranks(tree: DraftTree) -> list[int]:
    """Each node's index among its siblings (`DraftTree.ranks`)."""
    return tree.ranks()


class TreeSelector:
    """The cost-aware selector of every speculative configuration (chains are trees of width 1)."""
    MIN_STEPS = 4  # steps measured before the fit is trusted (until then every proposal is verified)
    EXPLORE_EVERY = 8  # every 8th step verifies every proposal, so the fit keeps seeing long verifications

    def __init__(self, gamma: int, width: int, *, forget: float = 0.98, experts: bool = True,
                 read_s: float | None = None, accs: dict[str, Acceptance] | None = None):
        self.forget = forget
        # drafter → its acceptance estimate (the decoder's, shared with auto's controller: `attach`)
        self.accs = accs if accs is not None else {"self": Acceptance(gamma)}
        self.model = None  # auto's cost model (`attach`): the verification's line comes from it, not the fit
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0  # weighted sums of (rows computed, seconds)
        self.steps = self.cut = self.calls = 0  # steps fitted; proposed nodes left out; choose_trees() calls
        self.width = width
        self.experts = experts  # False: SpecFit alone (no expert term)
        self.mode = "cost" if experts else "cost-compute"
        self.read_s = read_s    # the calibrated cost model's seconds per expert read (None: measured here)
        self.provider = None
        self.freq: dict[int, list[float]] = {}  # layer → forgotten routed-token counts per expert
        self.tokens: dict[int, float] = {}      # layer → forgotten token count
        self.used: dict[int, list[int]] = {}    # layer → the last target forward's counts per expert
        self.resident: dict[int, set[int]] = {}  # layer → resident at the start of this step
        self.wait_n = self.wait_s = 0.0         # forgotten (experts fetched, seconds waited) of verifications
        self.fetched = 0                        # experts the verifications fetched (layer, expert) pairs
        self.predicted_new = 0.0                # experts the verified trees were predicted to fetch
        self.step_predicted = self.fetch_n = self.pred_n = 0.0  # this step's prediction; forgotten sums
        self.expert_s_used = 0.0
        self.selection_s = 0.0  # host seconds spent choosing subtrees

    def cost(self) -> tuple[float, float] | None:
        """(a, c) of t ≈ a + c·rows, None while it cannot be fitted (too few steps, no spread)."""
        if self.steps < self.MIN_STEPS:
            return None
        var = self.n * self.sxx - self.sx * self.sx
        if var <= 1e-12 * max(1.0, self.n * self.sxx):
            return None
        c = (self.n * self.sxy - self.sx * self.sy) / var
        a = (self.sy - c * self.sx) / self.n
        return (a, c) if c > 0 and a + c > 0 else None

    # ------------------------------------------------------------ the expert term's inputs
    def attach(self, runner, accs: dict[str, Acceptance] | None = None, model=None) -> None:
        """Price nodes with `accs` (the decoder's acceptance estimates, which it records) and, under `auto`, the
        verification with `model` (the controller's `CostModel.verify_line`, one pricing for the plans and the
        selection; without one, the online fit `cost`), and watch the runner's target forwards (routing
        frequency, what each verification fetched) and its store (what is resident). On a store that holds every
        expert the expert term is always 0 and is switched off."""
        if accs is not None:
            self.accs = accs
        if model is not None:
            self.model, self.read_s = model, model.read_s
        if runner.provider.holds_all:  # every expert resident: no expert term (and no host reads of routing)
            self.experts = False
            return
        self.provider = runner.provider
        runner.observers.append(self.observe)

    def observe(self, layer: int, routing) -> None:
        counts = routing.counts_host
        f = self.forget
        acc = self.freq.setdefault(layer, [0.0] * len(counts))
        for e, c in enumerate(counts):
            acc[e] = f * acc[e] + c
        self.tokens[layer] = f * self.tokens.get(layer, 0.0) + routing.real_tokens
        self.used[layer] = counts

    def expected(self) -> dict:
        """(layer, expert) → P(a token routes there), from the recent routing frequency (one shared object)."""
        out = {}
        for layer, acc in self.freq.items():
            n = self.tokens.get(layer, 0.0)
            if n > 0:
                out.update({(layer, e): min(1.0, c / n) for e, c in enumerate(acc) if c > 0})
        return out

    def expert_s(self) -> float:
        if self.read_s is not None:
            return self.read_s
        return self.wait_s / self.wait_n if self.wait_n > 0 else 0.0

    def prob(self, depth: int, rank: int, drafter: str | None = None) -> float:
        """P(node accepted | parent accepted) for `drafter`'s nodes (None: the first drafter's)."""
        acc = self.accs[drafter] if drafter is not None else next(iter(self.accs.values()))
        return acc.node_prob(depth, rank)

    def nodes_of(self, trees: list[DraftTree], drafters: list[str | None] | None = None
                 ) -> tuple[list[DraftNode], list[tuple[int, int]], dict]:
        """The batch's forest as `DraftNode`s (P from the acceptance measured for each row's drafter, `drafters[b]`;
        experts as in the module docstring), each node's (row, index) and `covered`: (layer, expert) → P(already in
        the union) for the resident experts and the pending tokens' experts."""
        guess = self.expected() if self.experts else {}
        nodes, where = [], []
        for b, t in enumerate(trees):
            base = len(nodes)
            who = drafters[b] if drafters is not None else None
            for i, (p, d, k) in enumerate(zip(t.parents, t.depths(), ranks(t))):
                ex = t.experts[i] if t.experts is not None and t.experts[i] is not None else guess
                nodes.append(DraftNode(seq=b, parent=base + p if p >= 0 else -1, p=self.prob(d, k, who),
                                       experts=ex if self.experts else frozenset()))
                where.append((b, i))
        miss = missing({(layer, e) for layer, es in self.resident.items() for e in es})
        if self.experts:
            union_added([t.root_experts if t.root_experts is not None else guess for t in trees], miss)
        return nodes, where, {k: 1.0 - m for k, m in miss.items()}

    def snapshot(self) -> None:
        """What is resident now (the union's starting point), before this step's verification."""
        if self.provider is not None and self.experts:
            self.resident = {layer: set(self.provider.resident(layer)) for layer in self.freq}

    def choose_trees(self, trees: list[DraftTree], drafters: list[str | None] | None = None) -> list[DraftTree]:
        """The subtree of each proposal to verify this step (row b drafted by `drafters[b]`; its host time:
        `selection_s`)."""
        t0 = time.perf_counter()
        try:
            return self._choose(trees, drafters)
        finally:
            self.selection_s += time.perf_counter() - t0

    def line(self, B: int) -> tuple[float, float] | None:
        """(a, c) of the verification time a + c·rows: the cost model's when attached, else the online fit."""
        return self.model.verify_line(B) if self.model is not None else self.cost()

    def _choose(self, trees: list[DraftTree], drafters) -> list[DraftTree]:
        self.snapshot()
        fit = self.line(len(trees))
        self.calls += 1
        if fit is None and self.steps >= self.MIN_STEPS and self.calls % 2 == 0:
            chains = [self.chain_of(t) for t in trees]  # no spread in rows yet (same-size trees): verify chains
            self.cut += sum(len(t) - len(c) for t, c in zip(trees, chains))
            trees = chains
        if fit is None or not any(len(t) for t in trees) or self.calls % self.EXPLORE_EVERY == 0:
            self._predict(trees)
            return trees
        nodes, where, covered = self.nodes_of(trees, drafters)
        r = self.expert_s() * self.union_scale() if self.experts else 0.0
        self.expert_s_used = r
        sets = self.select_sets(nodes, len(trees), (*fit, r), covered)
        keep = [[where[i][1] for i in S] for S in sets]
        self.cut += len(nodes) - sum(len(k) for k in keep)
        chosen = [t.restrict(k) for t, k in zip(trees, keep)]
        self._predict(chosen)
        return chosen

    @staticmethod
    def chain_of(tree: DraftTree) -> DraftTree:
        """The tree's first-child chain (rank 0 at every depth)."""
        keep: list[int] = []
        for i, (p, k) in enumerate(zip(tree.parents, ranks(tree))):
            if k == 0 and (p < 0 or (keep and keep[-1] == p)):
                keep.append(i)
        return tree.restrict(keep)

    def _predict(self, trees: list[DraftTree]) -> None:
        """The expected fetches (pending tokens + nodes, beyond the resident experts) of the trees verified."""
        if not self.experts or self.provider is None:
            return
        guess = self.expected()
        sets = [t.root_experts if t.root_experts is not None else guess for t in trees]
        sets += [e if e is not None else guess for t in trees for e in (t.experts or [None] * len(t))]
        self.step_predicted = union_added(sets, missing({(lay, e) for lay, es in self.resident.items() for e in es}))

    def union_scale(self) -> float:
        """Measured / predicted fetches of recent verifications (tokens of one sequence route alike, so the
        independent-token expectation overcounts the union; like the cost model's miss refinement), in [0.05, 1]."""
        return min(1.0, max(0.05, self.fetch_n / self.pred_n)) if self.pred_n > 0 else 1.0

    @staticmethod
    def padded_objective(nodes: list[DraftNode], P: list[float], sets: list[list[int]], fit: tuple,
                         covered=frozenset()) -> float:
        """(B + Σ P) / (a + c · B · (1 + max_b |S_b|) + r · expected new experts); fit = (a, c) or (a, c, r)."""
        a, c = fit[:2]
        r = fit[2] if len(fit) > 2 else 0.0
        B = len(sets)
        t = a + c * B * (1 + max((len(S) for S in sets), default=0))
        if r:
            t += r * union_added([nodes[i].experts for S in sets for i in S], missing(covered))
        return (B + sum(P[i] for S in sets for i in S)) / t

    @classmethod
    def select_sets(cls, nodes: list[DraftNode], B: int, fit: tuple, covered=frozenset()) -> list[list[int]]:
        """Per sequence, the node indices (into `nodes`) to verify, by the padded objective with the expert
        term (fit = (a, c) or (a, c, r)). Candidates: the k most probable nodes per sequence for every k, the
        greedy by P(v)/ΔT(v) (`selection.select`, expert term included) and every uniform chain prefix."""
        P = path_probs(nodes)
        order: list[list[int]] = [[] for _ in range(B)]
        for i in sorted(range(len(nodes)), key=lambda i: (-P[i], i)):  # a parent before its children
            order[nodes[i].seq].append(i)
        cands = [[o[:k] for o in order] for k in range(max(len(o) for o in order) + 1)]
        a, c = fit[:2]
        r = fit[2] if len(fit) > 2 else 0.0
        spec = select(nodes, B, VerifyCost(base_s=max(a + c * B, 1e-9), token_s=c * B, expert_s=r),
                      covered=covered)  # SpecFit / EcoSpec greedy
        for S in [spec] + uniform_chains(nodes, len(nodes)):
            cands.append([[i for i in S if nodes[i].seq == b] for b in range(B)])
        return max(cands, key=lambda sets: (cls.padded_objective(nodes, P, sets, fit, covered),
                                            -sum(map(len, sets))))

    def record_trees(self, trees: list[DraftTree], positions: int, seconds: float, wait_s: float = 0.0) -> None:
        """One step's verification cost (its acceptance is recorded by the decoder into `accs`): the forward over
        `trees` covered `positions` rows in `seconds`, of which it waited `wait_s` for expert loads."""
        f = self.forget
        if self.experts:  # the verification's fetches: its union beyond what was resident at the start
            fetched = sum(sum(1 for e, c in enumerate(self.used.get(layer, ())) if c and e not in res)
                          for layer, res in self.resident.items())
            self.fetched += fetched
            self.predicted_new += self.step_predicted
            self.fetch_n, self.pred_n = f * self.fetch_n + fetched, f * self.pred_n + self.step_predicted
            self.step_predicted = 0.0
            self.wait_n, self.wait_s = f * self.wait_n + fetched, f * self.wait_s + wait_s
            seconds = max(seconds - wait_s, 1e-9)  # (a, c): the compute; the reads are the expert term
        self.n, self.sx, self.sy = f * self.n + 1, f * self.sx + positions, f * self.sy + seconds
        self.sxx, self.sxy = f * self.sxx + positions * positions, f * self.sxy + positions * seconds
        self.steps += 1

    def stats(self) -> dict:
        fit = self.cost()
        st = {"draft_selection": self.mode, "selection_cut_tokens": self.cut,
              "selection_cost_fit": None if fit is None else {"base_s": fit[0], "per_position_s": fit[1]},
              "selection_time_source": "cost model" if self.model is not None else "fit"}
        st["selection_accept_probs"] = {n: a.node_table() for n, a in self.accs.items()}
        st.update(draft_selection=self.mode, selection_expert_term=self.experts,
                  selection_expert_s=self.expert_s_used,
                  selection_expert_s_source="cost model" if self.read_s is not None else "measured wait",
                  selection_fetched_experts=self.fetched, selection_predicted_new_experts=self.predicted_new,
                  selection_union_scale=self.union_scale(), selection_s=self.selection_s)
        return st
