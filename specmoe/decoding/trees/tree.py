"""Token trees for speculative verification (`draft_tree=True`): the tree a drafter proposes per sequence,
how a batch of trees becomes one verification forward, and the acceptance rules over a tree.

A sequence's tree has its pending token as root (row 0 of the forward) and drafted nodes 1..n; node i's
parent is `parents[i]` (< i, -1 = the root). In the verification forward row t = node t (root 0, node i at
row i + 1) sits at RoPE position length + depth(t), writes its K/V at the scratch position length + t and
attends to the committed prefix + its ancestors + itself (`ancestor_mask`, the forward's `BatchView.tree`).

Acceptance walks down from the root. At a node whose target pick is known (greedy: argmax; forced: the
request's forced token at that output position; seeded: the
Gumbel-max pick with the noise of that output position, `sampling.coupled_pick`) it follows the child whose
token equals the pick, and emits the pick where no child matches (correction) or at a leaf (bonus): the
output is the target's own tokens, whatever was drafted (greedy == AR, seeded == plain seeded decoding).
Unseeded sampled rows use multi-draft recursive rejection sampling (SpecInfer): at a node with target
distribution p, try its children in order: accept child x (drawn from q) with probability
min(1, p(x)/q(x)); on rejection p ← norm(max(0, p − q)) and try the next child; when none is accepted emit
a sample from the residual p. With deterministic drafts (q = δ(x), lookup drafters) a rejection removes x
from p; with sampled drafts, the children of a node must be independent draws from the same q. Either way
the emitted token follows p.

After acceptance the accepted path's K/V (rows i_1 < i_2 < ...) is moved to consecutive positions
length + 1, length + 2, ... (`compaction`, one `KVCache.move`), so the cache holds what plain decoding
would have written.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from specmoe.decoding.runtime.sampling import check_finite, coupled_pick, finite_rows, probs_from_logits
from specmoe.decoding.runtime.sequence import Sequence

# B=sequences, T=verified rows per sequence (root + nodes, padded), V=vocab


@dataclass
class DraftTree:
    """One sequence's draft tree: node i is `tokens[i]` with parent `parents[i]` (< i; -1: the pending
    token). `q` [n, V]: for unseeded sampled rows, the distribution each node's token was drawn from (the
    children of one node: independent draws from the same q); None: deterministic drafts (one-hot q).
    `experts[i]`: the (layer, expert) pairs the target's routers picked for node i's token in the draft forward
    (None: not known, the node was never forwarded); `root_experts` the same for the pending token. Only
    the cost-aware selector reads them (`treeselect`)."""
    tokens: list[int]
    parents: list[int]
    q: torch.Tensor | None = None
    experts: list[frozenset | None] | None = None
    root_experts: frozenset | None = None
    # (drafts [B', G] on the device, row): the tokens are still there, `tokens` holds placeholders until they
    # are read (`read_tokens`, or `accept` in its one host read); the verification input is built from them
    # on the device, so a drafter need not read its drafts to the host before verification
    src: tuple[torch.Tensor, int] | None = None

    def __post_init__(self):
        if len(self.tokens) != len(self.parents) or any(not -1 <= p < i for i, p in enumerate(self.parents)):
            raise ValueError(f"a draft tree needs one parent per node, each before its child: {self.parents}")

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        """Each node the child of the one before it (or no node): verifies with the causal mask."""
        return all(p == i - 1 for i, p in enumerate(self.parents))

    def depths(self) -> list[int]:
        """Depth of every node (children of the root: 1)."""
        d: list[int] = []
        for p in self.parents:
            d.append(1 + (d[p] if p >= 0 else 0))
        return d

    def depth(self) -> int:
        return max(self.depths(), default=0)

    def ranks(self) -> list[int]:
        """Each node's index among its siblings (children in order; a chain's nodes are all rank 0)."""
        seen: dict[int, int] = {}
        out = []
        for p in self.parents:
            out.append(seen.get(p, 0))
            seen[p] = out[-1] + 1
        return out

    def children(self) -> list[list[int]]:
        """children[r] = the forward rows of row r's children (row 0 = root, node i = row i + 1), in order."""
        kids: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, p in enumerate(self.parents):
            kids[p + 1].append(i + 1)
        return kids

    def restrict(self, keep) -> DraftTree:
        """The subtree of the nodes in `keep` (ancestor-closed), renumbered in their order."""
        read_tokens([self])
        keep = sorted(keep)
        new = {-1: -1}
        for j, i in enumerate(keep):
            if self.parents[i] not in new:
                raise ValueError(f"node {i} kept without its parent {self.parents[i]}")
            new[i] = j
        q = None if self.q is None or not keep else self.q[torch.tensor(keep, device=self.q.device)]
        ex = None if self.experts is None else [self.experts[i] for i in keep]
        return DraftTree([self.tokens[i] for i in keep], [new[self.parents[i]] for i in keep], q, ex,
                         self.root_experts)


def read_tokens(trees: list[DraftTree]) -> None:
    """Read the tokens of trees still on the device (`DraftTree.src`) to the host: one read per source tensor."""
    by_src: dict[int, tuple[torch.Tensor, list[DraftTree]]] = {}
    for t in trees:
        if t.src is not None:
            by_src.setdefault(id(t.src[0]), (t.src[0], []))[1].append(t)
    for drafts, ts in by_src.values():
        rows = drafts.tolist()
        for t in ts:
            t.tokens[:] = rows[t.src[1]][:len(t)]
            t.src = None


def chain(tokens: list[int], q: torch.Tensor | None = None) -> DraftTree:
    """A chain as a tree (each node the child of the previous one)."""
    return DraftTree(list(tokens), list(range(-1, len(tokens) - 1)), q)


def trie(paths: list[list[int]]) -> DraftTree:
    """Token paths from the root merged into a trie (shared prefixes once), nodes in the order first seen:
    the first path's nodes come first and each node's children in the order of the paths."""
    tokens, parents, index = [], [], {}
    for path in paths:
        parent = -1
        for tok in path:
            key = (parent, tok)
            if key not in index:
                index[key] = len(tokens)
                tokens.append(tok)
                parents.append(parent)
            parent = index[key]
    return DraftTree(tokens, parents)


def ancestor_mask(tree: DraftTree, T: int) -> list[list[bool]]:
    """[T, T]: row t sees row u iff u is t's ancestor or t itself (rows past the tree see only themselves)."""
    m = [[False] * T for _ in range(T)]
    m[0][0] = True
    for i, p in enumerate(tree.parents):
        m[i + 1] = list(m[p + 1])
        m[i + 1][i + 1] = True
    for t in range(len(tree) + 1, T):
        m[t][t] = True
    return m


def pack(seqs: list[Sequence], trees: list[DraftTree], device: torch.device):
    """The verification batch: tokens [B, T] (pending token + nodes, padded), lens[b] = 1 + nodes,
    depths [B, T] and the ancestor mask [B, T, T] (bool), on the device. When every tree is a chain the mask
    is None (the causal mask is the ancestor mask: the forward takes its plain form) and depths[b, t] = t."""
    lens = [len(t) + 1 for t in trees]
    T = max(lens)
    toks = torch.tensor([[s.output_ids[-1]] + t.tokens + [0] * (T - n) for s, t, n in zip(seqs, trees, lens)],
                        device=device)
    by_src: dict[int, tuple[torch.Tensor, list[int]]] = {}  # chains whose tokens are still on the device
    for b, t in enumerate(trees):
        if t.src is not None:
            by_src.setdefault(id(t.src[0]), (t.src[0], []))[1].append(b)
    for drafts, rows in by_src.values():
        G = min(drafts.shape[1], T - 1)
        idx = torch.tensor(rows, device=device)
        src = drafts[torch.tensor([trees[b].src[1] for b in rows], device=device), :G]  # [r, G]
        real = torch.arange(G, device=device)[None, :] < torch.tensor([len(trees[b]) for b in rows],
                                                                        device=device)[:, None]
        toks[idx, 1:G + 1] = torch.where(real, src, toks[idx, 1:G + 1])
    if all(t.is_chain for t in trees):
        return toks, lens, torch.arange(T, device=device).expand(len(trees), T), None
    deps = [[0] + t.depths() + [0] * (T - n) for t, n in zip(trees, lens)]
    mask = [ancestor_mask(t, T) for t in trees]
    return toks, lens, torch.tensor(deps, device=device), torch.tensor(mask, dtype=torch.bool, device=device)


def accept(seqs: list[Sequence], trees: list[DraftTree], logits: torch.Tensor, depths: torch.Tensor,
           noise: dict[int, torch.Tensor] | None = None, tokens: torch.Tensor | None = None
           ) -> tuple[list[list[int]], list[list[int]]]:
    """(paths, out): paths[b] = the forward rows of b's accepted path (root 0 first), out[b] = the tokens
    to emit (the accepted nodes' tokens + the correction/bonus). logits [B, T, V]; depths [B, T];
    noise[b] [depth + 1, V] for seeded rows (row j: the output position j after the pending token);
    tokens [B, T]: the verification input (`pack`), read with the target's picks to fill the tokens of trees
    still on the device."""
    noise = noise or {}
    B, T = logits.shape[:2]
    dev = logits.device
    deferred = [t for t in trees if t.src is not None]
    if deferred and tokens is None:
        read_tokens(deferred)
        deferred = []
    lens = torch.tensor([len(t) + 1 for t in trees], device=dev)
    real = torch.arange(T, device=dev)[None, :] < lens[:, None]
    finite = (finite_rows(logits) | ~real).all(-1)  # [B]: the verified rows hold no inf/NaN
    exact = [b for b, s in enumerate(seqs) if s.params.greedy or b in noise]
    paths: list[list[int]] = [[] for _ in range(B)]
    out: list[list[int]] = [[] for _ in range(B)]
    if len(exact) < B:
        if deferred:
            read_tokens(deferred)
            deferred = []
        check_finite(finite.tolist())  # before rejection sampling meets NaN
    if exact:
        tgt = logits.argmax(-1)  # [B, T]
        for b, n in noise.items():
            k = len(trees[b]) + 1
            tgt[b, :k] = coupled_pick(logits[b, :k], seqs[b].params, n[depths[b, :k]])
        for b, s in enumerate(seqs):  # forced rows: the target's pick at depth j is the document's next token
            if s.params.forced_tokens is not None:
                k, start = len(trees[b]) + 1, len(s.output_ids)
                tgt[b, :k] = torch.tensor([s.params.forced_at(start + j) for j in depths[b, :k].tolist()],
                                          device=dev)
        parts = [tgt, finite[:, None].long()] + ([tokens] if deferred else [])
        rows = torch.cat(parts, 1).tolist()  # one host read: picks | finite | (the drafts still on the device)
        for b, t in enumerate(trees):
            if t.src is not None:
                t.tokens[:] = rows[b][T + 2: T + 2 + len(t)]
                t.src = None
        check_finite([r[T] == 1 for r in rows])
        for b in exact:
            paths[b], out[b] = _walk_exact(trees[b], rows[b])
    for b, s in enumerate(seqs):
        if b not in noise and not s.params.greedy:
            paths[b], out[b] = _walk_rejection(trees[b], logits[b], s)
    return paths, out


def _walk_exact(tree: DraftTree, pick: list[int]) -> tuple[list[int], list[int]]:
    kids = tree.children()
    path, out = [0], []
    while True:
        r = path[-1]
        nxt = next((c for c in kids[r] if tree.tokens[c - 1] == pick[r]), None)
        out.append(pick[r])
        if nxt is None:
            return path, out
        path.append(nxt)


def _walk_rejection(tree: DraftTree, logits: torch.Tensor, s: Sequence) -> tuple[list[int], list[int]]:
    """Multi-draft recursive rejection sampling down the tree with the sequence's own generator."""
    kids, gen = tree.children(), s.generator
    path, out = [0], []
    while True:
        r = path[-1]
        p = probs_from_logits(logits[r], s.params)  # [V]
        nxt = None
        for c in kids[r]:
            x = tree.tokens[c - 1]
            if tree.q is None:
                q_x, q = 1.0, None
            else:
                q = tree.q[c - 1]
                q_x = float(q[x])
            u = float(torch.rand((), generator=gen, device=p.device))
            if u * q_x < float(p[x]):  # accept with probability min(1, p(x)/q(x))
                nxt = c
                break
            if q is None:
                resid = p.clone()
                resid[x] = 0.0  # max(0, p − δ(x)): p(x) ≤ 1
            else:
                resid = (p - q).clamp_min(0)
            mass = resid.sum()
            if mass > 0:  # p ≤ q everywhere only by rounding: keep p then
                p = resid / mass
        if nxt is None:
            out.append(int(torch.multinomial(p, 1, generator=gen)))
            return path, out
        out.append(tree.tokens[nxt - 1])
        path.append(nxt)


def compaction(seqs: list[Sequence], paths: list[list[int]], lengths: list[int], max_seq: int):
    """(src, dst) flat KV rows (slot · max_seq + position) that move each accepted path onto consecutive
    positions: path row i_k at length + i_k → length + k. Empty when every path is already in place."""
    src, dst = [], []
    for s, path, L in zip(seqs, paths, lengths):
        for k, r in enumerate(path):
            if r != k:
                src.append(s.slot * max_seq + L + r)
                dst.append(s.slot * max_seq + L + k)
    return src, dst
