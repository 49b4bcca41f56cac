"""Sampled token trees keep the target distribution (multi-draft recursive rejection sampling: deterministic
lookup children and children drawn i.i.d. from a draft q; the distance to p falls as samples grow), an
engine run of unseeded sampled tree speculation follows the target, and cost-aware tree selection returns
ancestor-closed subtrees never worse (by the objective) than the chain selection of the same budget."""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from specmoe import LLM, SamplingParams
from specmoe.decoding.trees.selection import DraftNode, VerifyCost, chain_nodes, is_ancestor_closed, objective, select
from specmoe.decoding.runtime.sequence import Sequence
from specmoe.decoding.trees.tree import DraftTree, accept, chain, trie
from specmoe.decoding.trees.treeselect import TreeSelector, ranks
from tests.decoding.test_drafters import code_prompts

V = 8


def _tv(samples: torch.Tensor, p: torch.Tensor) -> float:
    emp = torch.bincount(samples, minlength=p.numel()).float() / max(samples.numel(), 1)
    return 0.5 * (emp - p).abs().sum().item()


def _rows(n: int, offset: int) -> list[Sequence]:
    return [Sequence(seq_id=i, prompt_ids=[1], params=SamplingParams(max_tokens=8, temperature=1.0), slot=i,
                     generator=torch.Generator().manual_seed(offset + i), output_ids=[1]) for i in range(n)]


def _sample(tree_of, n: int, p: torch.Tensor, offset: int):
    """n unseeded rows, each with its own tree (tree_of(i)); the target law at forward row r is p[r]."""
    seqs = _rows(n, offset)
    trees = [tree_of(i) for i in range(n)]
    T = max(len(t) for t in trees) + 1
    logits = torch.log(p[:T]).expand(n, T, V).clone()
    depths = torch.zeros(n, T, dtype=torch.long)
    return trees, accept(seqs, trees, logits, depths)


def _dists(seed: int, rows: int):
    g = torch.Generator().manual_seed(seed)
    return torch.softmax(torch.randn(rows, V, generator=g) * 1.5, -1)


def test_lookup_tree_rejection_keeps_the_target_law():
    """Root children 3, 5, 1 (deterministic, distinct); node 3 has children 2, 6. The first emitted token
    must follow p[0]; the second, given the first is 3 (row 1), p[1]."""
    p = _dists(0, 6)
    tree = DraftTree([3, 5, 1, 2, 6], [-1, -1, -1, 0, 0])
    tvs, stats = [], None
    for n in (300, 12_000):
        trees, (paths, out) = _sample(lambda i: tree, n, p, offset=n)
        first = torch.tensor([o[0] for o in out])
        second = torch.tensor([o[1] for o in out if o[0] == 3])
        tvs.append((_tv(first, p[0]), _tv(second, p[1])))
        stats = (sum(len(x) > 1 and x[1] == 2 for x in paths), sum(len(x) > 1 and x[1] > 1 for x in paths),
                 sum(len(x) == 1 for x in paths))
    (a0, a1), (b0, b1) = tvs
    assert all(s > 0 for s in stats), f"first child, a later sibling, and no child accepted: {stats}"
    assert b0 < 0.02 and b1 < 0.04, tvs
    assert b0 < a0 and b1 < a1, f"the distance to p must shrink as samples grow: {tvs}"
    for path, toks in zip(paths, out):  # the path's node tokens are the emitted tokens
        assert [tree.tokens[r - 1] for r in path[1:]] == toks[:len(path) - 1]


def test_sampled_children_tree_rejection_keeps_the_target_law():
    """Three children of the root drawn i.i.d. from q ≠ p (duplicates kept as separate nodes)."""
    p, q = _dists(1, 4), _dists(2, 1)[0]
    assert 0.5 * (p[0] - q).abs().sum() > 0.2
    tvs = []
    for n in (300, 12_000):
        g = torch.Generator().manual_seed(n)
        draws = torch.multinomial(q, 3 * n, replacement=True, generator=g).view(n, 3).tolist()
        _, (paths, out) = _sample(lambda i: DraftTree(draws[i], [-1, -1, -1], q.expand(3, V)), n, p, offset=7 * n)
        tvs.append(_tv(torch.tensor([o[0] for o in out]), p[0]))
        accepted = sum(len(x) > 1 for x in paths)
        assert 0 < accepted < n
    assert tvs[1] < 0.02 and tvs[1] < tvs[0], tvs


def test_unseeded_sampled_tree_speculation_follows_the_target():
    """Demo model, a code prompt: the 2nd token of each request comes from a tree step: E[p(x)] over the
    emitted x must be E[Σ p²] (the target's law); accepting lookup drafts unchecked would drift to them."""
    llm = LLM(dtype="float32", threads=1, decoding="specmoe", drafter="ngram", draft_tree=True, draft_tree_width=3,
              num_draft_tokens=2, ngram_min=1)
    prompt, n = llm.tokenizer.encode(code_prompts(1)[0]), 400
    spec = llm.generate([prompt] * n, SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True))
    st = llm.stats
    assert st["tree_branched_rows"] > 0 and 0 < st["accepted_tokens"] < st["tree_nodes_verified"], st
    logits = LLM(dtype="float32", threads=1).logits([prompt + [o.token_ids[0]] for o in spec])
    p = torch.softmax(logits[:, len(prompt)], -1)
    got = torch.tensor([p[i, o.token_ids[1]].item() for i, o in enumerate(spec)])
    want = (p * p).sum(-1)
    assert abs(got.mean() - want.mean()) < 4 * got.std() / n ** 0.5 + 1e-3


def test_trie_merges_shared_prefixes_and_chain_is_a_tree():
    t = trie([[1, 2, 3], [1, 2, 4], [5], [1, 6]])
    assert t.tokens == [1, 2, 3, 4, 5, 6] and t.parents == [-1, 0, 1, 1, -1, 0]
    assert t.depths() == [1, 2, 3, 3, 1, 2] and t.depth() == 3 and ranks(t) == [0, 0, 0, 1, 1, 1]
    c = chain([7, 8, 9])
    assert c.parents == [-1, 0, 1] and c.depth() == 3
    sub = t.restrict([0, 1, 3, 4])
    assert sub.tokens == [1, 2, 4, 5] and sub.parents == [-1, 0, 1, -1]
    with pytest.raises(ValueError):
        t.restrict([1, 2])  # node 1 without its parent


def _forest(rng, B):
    trees = []
    for _ in range(B):
        n = rng.randint(0, 6)
        trees.append(DraftTree([rng.randrange(50) for _ in range(n)], [rng.randrange(-1, i) for i in range(n)]))
    return trees


def _best_chain(nodes, B, cost, budget):
    ch = sorted(chain_nodes(nodes))
    best = objective(nodes, [], B, cost)
    for r in range(1, min(budget, len(ch)) + 1):
        for S in itertools.combinations(ch, r):
            if is_ancestor_closed(nodes, S):
                best = max(best, objective(nodes, S, B, cost))
    return best


@pytest.mark.parametrize("seed", range(20))
def test_tree_selection_is_closed_and_never_below_the_chain_of_its_budget(seed):
    rng = random.Random(seed)
    B = rng.randint(1, 3)
    trees = _forest(rng, B)
    sel = TreeSelector(gamma=6, width=3)
    acc = sel.accs["self"]
    for d in range(6):  # measured acceptance by depth and rank
        for k in range(3):
            acc.reach[d, k], acc.hit[d, k] = 10.0, rng.uniform(0, 10)
    nodes, where, _ = sel.nodes_of(trees)
    assert all(v.p == sel.prob(t.depths()[i], ranks(t)[i]) for v, (b, i) in zip(nodes, where) for t in [trees[b]])
    cost = VerifyCost(base_s=rng.uniform(0.5, 2), token_s=rng.uniform(0.01, 0.6))
    budget = rng.randint(1, max(1, len(nodes)))
    S = select(nodes, B, cost, budget=budget)
    assert is_ancestor_closed(nodes, S) and len(S) <= budget
    assert objective(nodes, S, B, cost) >= _best_chain(nodes, B, cost, budget) - 1e-12


def test_tree_selector_cuts_unlikely_branches_once_fitted():
    sel = TreeSelector(gamma=3, width=3)
    t = trie([[1, 2, 3], [4, 5], [6]])  # rank-0 chain 1-2-3, siblings 4 (→5) and 6
    assert sel.choose_trees([t]) == [t], "before a fit every node is verified"
    for i in range(8):  # cost 1 s + 0.5 s per row; the chain is always accepted, siblings never
        rows = 1 + len(t) - (i % 3)
        sel.record_trees([t], rows, 1.0 + 0.5 * rows)
        sel.accs["self"].record([0], [t.depth()], [3], [[]], [t], [[0, 1, 2, 3]])  # (the decoder records it)
    kept = sel.choose_trees([t])[0]
    assert kept.tokens == [1, 2, 3] and kept.parents == [-1, 0, 1]
    assert sel.stats()["selection_cut_tokens"] == 3
    assert sel.prob(1, 0) > 0.8 and sel.prob(1, 1) < 0.2


def test_chains_are_trees_of_width_one():
    from specmoe.decoding.trees.tree import chain, trie
    c = chain([4, 5, 6])
    assert c.is_chain and c.parents == [-1, 0, 1] and c.q is None
    assert trie([[4, 5, 6]]).parents == c.parents and not trie([[4, 5], [4, 7]]).is_chain
    assert DraftNode(seq=0, parent=-1, p=0.5).p == 0.5


@pytest.mark.parametrize("seed", range(20))
def test_padded_tree_selection_beats_every_capped_chain(seed):
    """The selector's own choice (padded cost a + c·B·(1 + max |S_b|)) is ancestor-closed per sequence and
    scores at least as well as verifying the first k chain nodes of every sequence, for every k."""
    rng = random.Random(100 + seed)
    B = rng.randint(1, 4)
    trees = _forest(rng, B)
    sel = TreeSelector(gamma=6, width=3)
    acc = sel.accs["self"]
    for d in range(6):
        for k in range(3):
            acc.reach[d, k], acc.hit[d, k] = 10.0, rng.uniform(0, 10)
    nodes, _, _ = sel.nodes_of(trees)
    fit = (rng.uniform(0.5, 2), rng.uniform(0.01, 0.6))
    sets = TreeSelector.select_sets(nodes, B, fit)
    assert all(nodes[i].seq == b for b, S in enumerate(sets) for i in S)
    assert is_ancestor_closed(nodes, [i for S in sets for i in S])
    from specmoe.decoding.trees.selection import path_probs
    P = path_probs(nodes)
    ch = chain_nodes(nodes)
    got = TreeSelector.padded_objective(nodes, P, sets, fit)
    for k in range(7):
        chains = [sorted(i for i in ch if nodes[i].seq == b)[:k] for b in range(B)]  # chain order = index order
        assert got >= TreeSelector.padded_objective(nodes, P, chains, fit) - 1e-12


def test_unseeded_sampled_self_draft_tree_follows_the_target(tiny_ckpt):
    """Self-draft trees for unseeded rows: the root's children are i.i.d. draws from the draft's q; the 2nd
    token's law must be the target's given the first."""
    path = tiny_ckpt("mixtral")
    prompt, n = [5, 17, 33], 400
    llm = LLM(path, dtype="float32", decoding="specmoe", draft_tree=True, draft_tree_width=3, num_draft_tokens=2,
              draft_experts=2)
    spec = llm.generate([prompt] * n, SamplingParams(max_tokens=3, temperature=1.0))
    st = llm.stats
    assert st["tree_sibling_nodes"] >= n and 0 < st["accepted_tokens"] < st["tree_nodes_verified"], st
    logits = LLM(path, dtype="float32").logits([prompt + [o.token_ids[0]] for o in spec])
    p = torch.softmax(logits[:, len(prompt)], -1)
    got = torch.tensor([p[i, o.token_ids[1]].item() for i, o in enumerate(spec)])
    want = (p * p).sum(-1)
    assert abs(got.mean() - want.mean()) < 4 * got.std() / n ** 0.5 + 1e-3
