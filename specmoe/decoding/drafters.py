"""Drafters: where a speculative step's draft tokens come from (`drafter=` option).

A `Drafter` proposes up to γ_b tokens per sequence; the acceptance rule (`specmoe.accept`) is the same
for every drafter. Two drafters:

- `self` — SpecMoE's draft experts (`draft.DraftExperts` + `specmoe.draft`, run by `SpecMoEDecoder`,
  which also hosts `decoding="auto"`'s controller over that draft);
- `ngram` — prompt/output lookup (`NgramDrafter`, run by `drafted.DraftedDecoder`): the continuation of
  the latest earlier occurrence of the sequence's last n tokens (`ngram.NgramIndex`). No forward, no
  expert bytes; a proposal may be shorter than γ_b or empty, and that row then verifies fewer positions
  (only its pending token when empty).

Token trees (`draft_tree=True`, `treedecode.TreeDecoder`): `Drafter.propose_tree` returns a
`tree.DraftTree` per sequence; its default wraps `propose`'s chain, `NgramDrafter` merges several history
continuations into a trie and `selfdraft.SelfDrafter` (the self draft behind this interface) adds the
draft's next most likely tokens per depth as leaves. `prepare` / `begin_verify` / `end_verify` are hooks
around a step (no-ops by default; the self draft pins and refreshes its draft set there).

Losslessness: greedy and seeded sampled rows use the exact-match rule against the target's pick, which
does not depend on where drafts come from. Unseeded sampled rows use rejection sampling; a lookup draft
is deterministic given the history, i.e. drawn from the one-hot q = δ(draft), for which rejection
sampling accepts x with probability p(x) and otherwise resamples from p with x removed: exactly the
target's distribution.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from specmoe.decoding.ngram import NgramIndex
from specmoe.decoding.sequence import Sequence
from specmoe.decoding.tree import DraftTree, chain, trie

# B=sequences, G=max drafted tokens this step, V=vocab


@dataclass
class Proposal:
    """drafts [B, G] (long, on the device; row b real for its first gammas[b] entries), q [B, G, V] the
    draft distribution of the unseeded sampled rows (None when there are none) and gammas[b] ≤ the γ_b
    asked for (a drafter may propose fewer)."""
    drafts: torch.Tensor
    q: torch.Tensor | None
    gammas: list[int]


class Drafter(ABC):
    """A source of draft tokens for the shared verify + accept step."""
    name: str = ""

    @abstractmethod
    def propose(self, seqs: list[Sequence], gammas: list[int], noise: dict[int, torch.Tensor]) -> Proposal:
        """Up to gammas[b] draft tokens per sequence. Greedy rows: any tokens (exact-match acceptance);
        seeded sampled rows b: any tokens (`noise[b]` [γ_b+1, V] is the coupled rule's noise, for drafters
        that sample); unseeded sampled rows: tokens drawn from the returned q. Must leave the KV cache's
        committed lengths as they were."""

    def propose_tree(self, seqs: list[Sequence], gammas: list[int], width: int,
                     noise: dict[int, torch.Tensor]) -> list[DraftTree]:
        """A draft tree per sequence (`tree.DraftTree`, `draft_tree=True`): depth ≤ gammas[b], at most
        width · gammas[b] nodes, the children of a node distinct tokens (or, for unseeded sampled rows,
        independent draws from one q). The same rules as `propose` otherwise. Default: `propose`'s chain."""
        prop = self.propose(seqs, gammas, noise)
        rows = prop.drafts.tolist()
        return [chain(rows[b][:g], None if prop.q is None or not g or b in noise or s.params.greedy else prop.q[b, :g])
                for b, (s, g) in enumerate(zip(seqs, prop.gammas))]

    def prepare(self) -> None:
        """Called at the start of every step, before the draft phase is timed and its bytes counted: one-time
        setup (the self draft pins its draft set here)."""

    def begin_verify(self) -> None:
        """Called right before the verification forward (the self draft starts counting its routing)."""

    def end_verify(self) -> None:
        """Called right after the verification forward (the self draft refreshes its draft set)."""

    @abstractmethod
    def stats(self) -> dict:
        """The drafter's own counters for `llm.stats` (always its `drafter` name)."""


class NgramDrafter(Drafter):
    """Prompt and output lookup: one incremental `NgramIndex` per live sequence, fed the sequence's new
    tokens at each proposal (indexes of sequences no longer in the batch are dropped)."""
    name = "ngram"

    def __init__(self, vocab_size: int, device: torch.device, *, n_min: int = 2, n_max: int = 4):
        self.vocab, self.device = vocab_size, device
        self.n_min, self.n_max = n_min, n_max
        self.index: dict[int, NgramIndex] = {}
        self.owner: dict[int, Sequence] = {}  # the sequence each index was built from
        self.asked = self.proposed = self.empty = 0  # tokens asked for, tokens proposed, rows with none

    def _sync(self, s: Sequence) -> NgramIndex:
        idx = self.index.get(s.seq_id)
        if idx is None or self.owner[s.seq_id] is not s:  # a new sequence (ids may be reused across runs)
            idx = self.index[s.seq_id] = NgramIndex(self.n_min, self.n_max)
            self.owner[s.seq_id] = s
        n = len(idx.tokens)
        P = len(s.prompt_ids)
        if n < P:
            idx.extend(s.prompt_ids[n:])
            n = P
        idx.extend(s.output_ids[n - P:])
        return idx

    def _drop_gone(self, seqs: list[Sequence]) -> None:
        live = {s.seq_id for s in seqs}
        for sid in [k for k in self.index if k not in live]:
            del self.index[sid], self.owner[sid]

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], gammas: list[int], noise: dict[int, torch.Tensor]) -> Proposal:
        self._drop_gone(seqs)
        props = [self._sync(s).propose(g) for s, g in zip(seqs, gammas)]
        got = [len(p) for p in props]
        self.asked += sum(gammas)
        self.proposed += sum(got)
        self.empty += sum(1 for g, n in zip(gammas, got) if g > 0 and n == 0)
        B, G = len(seqs), max(got, default=0)
        drafts = torch.tensor([p + [0] * (G - len(p)) for p in props], dtype=torch.long,
                              device=self.device).reshape(B, G)
        q = None
        unseeded = [b for b, s in enumerate(seqs) if not s.params.greedy and b not in noise and got[b]]
        if unseeded:  # the lookup is deterministic: q is the one-hot of the proposed token
            q = torch.zeros(B, G, self.vocab, device=self.device)
            for b in unseeded:
                q[b, torch.arange(got[b], device=self.device), drafts[b, :got[b]]] = 1.0
        return Proposal(drafts, q, got)

    def propose_tree(self, seqs: list[Sequence], gammas: list[int], width: int,
                     noise: dict[int, torch.Tensor]) -> list[DraftTree]:
        """The trie of up to `width` distinct continuations of the history's matches (`propose_many`; the
        first is `propose`'s chain). Deterministic drafts: q is one-hot (None) for every row."""
        self._drop_gone(seqs)
        trees = [trie(self._sync(s).propose_many(g, width)) for s, g in zip(seqs, gammas)]
        got = [len(t) for t in trees]
        self.asked += sum(gammas)
        self.proposed += sum(got)
        self.empty += sum(1 for g, n in zip(gammas, got) if g > 0 and n == 0)
        return trees

    def stats(self) -> dict:
        return {"drafter": self.name, "ngram_min": self.n_min, "ngram_max": self.n_max,
                "draft_tokens_asked": self.asked, "draft_tokens_proposed": self.proposed,
                "empty_proposals": self.empty}
