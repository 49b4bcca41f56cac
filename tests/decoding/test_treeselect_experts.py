"""EcoSpec's expert term in the tree selector (`treeselect.TreeSelector`, `draft_selection="cost"`): a node
whose experts are resident beats an equally likely node that adds non-resident experts; selections stay
ancestor-closed and never score below a chain prefix of the same budget; the expected union of nodes known
only by routing frequency; end to end on the offloaded demo model the expert term moves no more bytes than
the same selection without it (`cost-compute`) and actually drops nodes, greedy output unchanged."""
from __future__ import annotations

import random

import pytest

from specmoe import LLM
from specmoe.decoding.trees.selection import DraftNode, is_ancestor_closed, missing, path_probs, uniform_chains, union_added
from specmoe.decoding.trees.treeselect import TreeSelector
from tests.decoding.test_drafters import BATCHES


def test_resident_experts_beat_equally_likely_non_resident_ones():
    nodes = [DraftNode(0, -1, 0.5, frozenset({(0, 1), (1, 2)})), DraftNode(0, -1, 0.5, frozenset({(0, 5), (1, 6)}))]
    # without the expert term both equally likely children are worth their padded row
    assert TreeSelector.select_sets(nodes, 1, (1.0, 0.1)) == [[0, 1]]
    # with it only the node whose experts are resident is verified, whichever of the two that is
    assert TreeSelector.select_sets(nodes, 1, (1.0, 0.1, 0.5), {(0, 1), (1, 2)}) == [[0]]
    assert TreeSelector.select_sets(nodes, 1, (1.0, 0.1, 0.5), {(0, 5), (1, 6)}) == [[1]]
    # an expected (routing-frequency) node that is most likely resident is preferred to a certain miss
    freq = {(0, 1): 0.9, (0, 7): 0.1}
    mixed = [DraftNode(0, -1, 0.5, freq), DraftNode(0, -1, 0.5, frozenset({(0, 5), (1, 6)}))]
    assert TreeSelector.select_sets(mixed, 1, (1.0, 0.1, 0.5), {(0, 1)}) == [[0]]


def test_expected_union_of_frequency_nodes():
    freq = {(0, 0): 0.5, (0, 1): 1.0}
    miss = missing({(0, 1)})
    # two nodes with the same routing frequency: expert 0 new with probability 1 − 0.5², expert 1 resident
    assert union_added([freq, freq], miss) == pytest.approx(0.75)
    assert miss[(0, 0)] == pytest.approx(0.25) and miss[(0, 1)] == 0.0
    # a known pick is the special case p = 1
    assert union_added([frozenset({(0, 0), (2, 3)})], miss) == pytest.approx(0.25 + 1.0)


def random_forest(rng, B, n):
    freq = {(rng.randrange(3), rng.randrange(6)): rng.random() for _ in range(6)}  # one shared expectation
    nodes = []
    for _ in range(n):
        seq = rng.randrange(B)
        parents = [-1] + [j for j, v in enumerate(nodes) if v.seq == seq]
        ex = freq if rng.random() < 0.3 else frozenset((rng.randrange(3), rng.randrange(6))
                                                       for _ in range(rng.randint(0, 4)))
        nodes.append(DraftNode(seq=seq, parent=rng.choice(parents), p=rng.random() ** 0.5, experts=ex))
    return nodes


@pytest.mark.parametrize("seed", range(40))
def test_selection_is_ancestor_closed_and_never_below_the_chain(seed):
    rng = random.Random(seed)
    B = rng.randint(1, 4)
    nodes = random_forest(rng, B, rng.randint(1, 14))
    fit = (rng.uniform(0.2, 2), rng.uniform(0.01, 0.3), rng.uniform(0.0, 0.4))
    covered = {(rng.randrange(3), rng.randrange(6)) for _ in range(5)}
    sets = TreeSelector.select_sets(nodes, B, fit, covered)
    flat = [i for S in sets for i in S]
    assert is_ancestor_closed(nodes, flat) and all(nodes[i].seq == b for b, S in enumerate(sets) for i in S)
    P = path_probs(nodes)
    got = TreeSelector.padded_objective(nodes, P, sets, fit, covered)
    for C in uniform_chains(nodes, len(nodes)):  # the chain prefix of every budget
        chain = [[i for i in C if nodes[i].seq == b] for b in range(B)]
        assert got >= TreeSelector.padded_objective(nodes, P, chain, fit, covered) - 1e-12
    assert got >= TreeSelector.padded_objective(nodes, P, [[] for _ in range(B)], fit, covered) - 1e-12


def _fixed_cost(monkeypatch, read_s):
    """Deterministic selection: a fixed compute fit and read time instead of the measured ones."""
    monkeypatch.setattr(TreeSelector, "cost", lambda self: (0.01, 0.002))
    monkeypatch.setattr(TreeSelector, "expert_s", lambda self: read_s)


@pytest.mark.parametrize("drafter", ["ngram", "self"])
def test_expert_term_moves_no_more_bytes_and_drops_nodes(tmp_path, monkeypatch, drafter):
    _fixed_cost(monkeypatch, 0.004)
    prompts, sp = BATCHES[7]
    ref = [o.token_ids for o in LLM(dtype="float32", threads=1).generate(prompts, sp)]
    kw = dict(dtype="float32", threads=1, decoding="specmoe", drafter=drafter, draft_tree=True,
              num_draft_tokens=3, draft_tree_width=3, offload="disk", repack_dir=str(tmp_path / "r"),
              cache_experts=10, cache_policy="lru", ngram_min=1)
    runs = {}
    for sel in ("cost-compute", "cost"):
        llm = LLM(**kw, draft_selection=sel)
        assert [o.token_ids for o in llm.generate(prompts, sp)] == ref
        runs[sel] = llm.stats
    eco, fit = runs["cost"], runs["cost-compute"]
    assert eco["draft_selection"] == "cost" and eco["selection_expert_term"] is True
    assert eco["selection_expert_s"] > 0 and eco["selection_fetched_experts"] > 0
    assert fit["selection_expert_s"] == 0 and fit["draft_selection"] == "cost-compute"
    assert eco["tree_nodes_proposed"] > eco["tree_nodes_verified"], "the expert term must drop nodes"
    assert eco["selection_cut_tokens"] > fit["selection_cut_tokens"]
    assert eco["expert_bytes_per_token"] * eco["generated_tokens"] <= fit["expert_bytes_per_token"] * fit[
        "generated_tokens"]


def test_self_draft_records_router_picks_per_chain_node(tmp_path, monkeypatch):
    """The self draft's trees carry the target routers' picks (before substitution) for the pending token and
    every chain node it forwarded; the chain's last node and the sibling leaves were never forwarded."""
    from specmoe.decoding.drafters.selfdraft import SelfDrafter
    seen = []
    orig = SelfDrafter.propose_tree

    def spy(self, *a, **kw):
        seen.extend(orig(self, *a, **kw))
        return seen[-len(a[0]):]
    monkeypatch.setattr(SelfDrafter, "propose_tree", spy)
    llm = LLM(dtype="float32", threads=1, decoding="specmoe", draft_tree=True, num_draft_tokens=3,
              draft_tree_width=3, draft_selection="cost", offload="disk", repack_dir=str(tmp_path / "r"),
              cache_experts=10,
              cache_policy="lru")
    llm.generate(*BATCHES[1])
    cfg = llm.config
    want = len(cfg.moe_layers) * cfg.top_k  # top-k distinct experts per MoE layer
    full = [t for t in seen if t.depth() == 3]
    assert full, "some steps drafted the full depth"
    for t in full:
        assert len(t.root_experts) == want and {layer for layer, _ in t.root_experts} == set(cfg.moe_layers)
        depths, kids = t.depths(), t.children()
        chain = {i for i in range(len(t)) if kids[t.parents[i] + 1][0] == i + 1}  # the rank-0 nodes
        for i in range(len(t)):
            assert (t.experts[i] is not None) == (i in chain and depths[i] < 3), (i, depths[i])
            if t.experts[i] is not None:
                assert len(t.experts[i]) == want
