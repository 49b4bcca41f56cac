"""Speculative decoding over token trees (`draft_tree=True`, `decoding="specmoe"` with a `Drafter`).

One step: the drafter proposes a tree per sequence (`Drafter.propose_tree`: depth ≤ γ_b, at most
`width` · γ_b nodes), the cost-aware selector (`draft_selection="cost"`, `treeselect.TreeSelector`) may
keep an ancestor-closed subtree of each, ONE target forward verifies every node of every sequence with a
tree attention mask (`ModelRunner.tree_view`), `tree.accept` walks each tree (exact-match for greedy and
seeded rows, multi-draft rejection sampling for unseeded ones), and the accepted path's K/V is compacted
onto consecutive positions (`KVCache.move`) before the accepted length is committed. Chains are trees with
one child per node; a row with an empty tree is a plain decoding step inside the same forward.
"""
from __future__ import annotations

import torch

from specmoe.decoding.breakdown import now
from specmoe.decoding.drafted import DraftedDecoder
from specmoe.decoding.sequence import Sequence
from specmoe.decoding.tree import accept, compaction, pack


class TreeDecoder(DraftedDecoder):
    def __init__(self, runner, drafter, *, num_draft_tokens: int, max_model_len: int, width: int, budget=None,
                 selector=None):
        super().__init__(runner, drafter, num_draft_tokens=num_draft_tokens, max_model_len=max_model_len,
                         budget=budget, selector=selector)
        self.width = width
        if selector is not None:
            selector.attach(runner)  # routing frequency, resident experts (the expert term of T(S))
        self.nodes = self.branched = self.moved = self.proposed_nodes = 0

    @torch.inference_mode()
    def step(self, seqs: list[Sequence]) -> dict[int, list[int]]:
        r, dev = self.runner, self.runner.device
        gammas, noise, t0, e0, b0 = self._begin(seqs)
        trees = self.drafter.propose_tree(seqs, gammas, self.width, noise)
        self.proposed_nodes += sum(len(t) for t in trees)
        if self.selector is not None:
            trees = self.selector.choose_trees(trees)
        self.draft_phase_bytes += r.provider.bytes_moved - b0
        t1 = now(dev)
        e1, w1 = r.expert_s, r.provider.fetch_wait_s
        tokens, lens, depths, mask = pack(seqs, trees, dev)
        lengths = [r.cache.lengths[s.slot] for s in seqs]
        ctx = r.context(routing_hook=self.budget)
        if self.budget is not None:  # padding rows do not vote
            self.budget.real = (torch.arange(tokens.shape[1], device=dev)[None, :]
                                < torch.tensor(lens, device=dev)[:, None]).reshape(-1)
        bv = r.tree_view(seqs, lens, depths, mask)
        self.drafter.begin_verify()
        try:
            logits = r.forward_padded(seqs, tokens, lens, ctx=ctx, all_logits=True, view=bv)  # [B, T, V]
        finally:
            self.drafter.end_verify()
        t2 = now(dev)
        paths, out = accept(seqs, trees, logits, depths, noise)
        src, dst = compaction(seqs, paths, lengths, r.cache.max_seq)
        if src:
            r.cache.move(torch.tensor(src, device=dev), torch.tensor(dst, device=dev))
        r.rerecord(seqs, paths, logits)
        if self.selector is not None:
            self.selector.record_trees(trees, paths, len(lens) * max(lens), t2 - t1,  # rows computed
                                       r.provider.fetch_wait_s - w1)
        for s, toks in zip(seqs, out):
            r.commit(s, len(toks))  # K/V of the pending token + the accepted path, now consecutive
        t3 = now(dev)
        self.step_bytes += r.provider.bytes_moved - b0
        self.breakdown.draft(t1 - t0, e1 - e0)
        self.breakdown.target(t2 - t1, r.expert_s - e1, r.provider.fetch_wait_s - w1)
        self.breakdown.accept(t3 - t2)
        depth = [t.depth() for t in trees]
        self.tally.record(out, depth, t1 - t0, t2 - t1, t3 - t2)
        self.tally.verified += sum(len(t) - d for t, d in zip(trees, depth))  # the nodes off the deepest path
        self.nodes += sum(len(t) for t in trees)
        self.branched += sum(1 for t in trees if len(t) > t.depth())
        self.moved += len(src)
        return {s.seq_id: toks for s, toks in zip(seqs, out)}

    def stats(self) -> dict:
        st = super().stats()
        n = self.tally.seq_steps
        st.update({"draft_tree": True, "draft_tree_width": self.width, "tree_nodes_verified": self.nodes,
                   "tree_nodes_proposed": self.proposed_nodes,
                   "tree_nodes_per_step": self.nodes / n if n else 0.0,
                   "tree_nodes_rejected": self.nodes - self.tally.stats()["accepted_tokens"],
                   "accepted_path_length": self.tally.stats()["accepted_tokens"] / n if n else 0.0,
                   "tree_branched_rows": self.branched, "tree_kv_rows_moved": self.moved})
        return st
