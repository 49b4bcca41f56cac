"""Drafters: where a speculative step's draft tokens come from (`drafter=` option; `decoding="auto"` may use
every drafter, a different one per sequence, in one step).

A `Drafter` proposes a draft tree per sequence (`propose_tree`, a chain when width is 1) of depth ≤ γ_b; the
step (`speculative.SpeculativeDecoder`) selects, verifies and accepts every row the same way, whichever
drafter proposed it. Three drafters:

- `self` — SpecMoE's draft experts (`selfdraft.SelfDrafter` over `draft.DraftExperts`);
- `eagle` — an EAGLE head over the target's own features (`eagle.EagleDrafter`);
- `ngram` — prompt/output lookup (`NgramDrafter`): the continuations of earlier occurrences of the
  sequence's last n tokens (`ngram.NgramIndex`). No forward, no expert bytes; a proposal may be shorter than
  γ_b or empty, and that row then verifies fewer positions (only its pending token when empty).

Hooks around a step (no-ops by default): `prepare` before the draft phase (the self draft pins its draft set),
`begin_verify` / `end_verify` around the verification forward (the self draft refreshes its draft set), `idle`
on a step the drafter sat out, `retire` with the live sequences (per-sequence state of finished ones is
dropped). `target_observers` are the runner observers the drafter registered: the step leaves them out of
forwards the drafter does not take part in, so a step without it costs what it would cost without it.

Losslessness: greedy and seeded sampled rows use the exact-match rule against the target's pick, which
does not depend on where drafts come from. Unseeded sampled rows use (multi-draft) rejection sampling; a
lookup draft is deterministic given the history, i.e. drawn from the one-hot q = δ(draft), for which
rejection sampling accepts x with probability p(x) and otherwise resamples from p with x removed: exactly
the target's distribution.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specmoe.decoding.runtime.sampling import coupled_pick, probs_from_logits
from specmoe.decoding.runtime.sequence import Sequence
from specmoe.decoding.trees.tree import DraftTree

# B=sequences, G=max drafted tokens this step, V=vocab

# called by model drafters with (depth j, batch rows drafting at j, their logits [len(rows), V]); may lower
# gammas[b] (the list passed to propose_tree, in place) to j + 1 for greedy rows b: they stop drafting there
DraftHook = Callable[[int, list, torch.Tensor], None]


@dataclass(frozen=True)
class DraftSet:
    """A drafter's resident target experts: `ids` per MoE layer (None until chosen: then its `size` hottest per
    layer will be), and whether `prepare` will first load or pin them (`needs_setup`)."""
    ids: dict[int, list[int]] | None
    size: int
    needs_setup: bool


class Drafter(ABC):
    """A source of draft trees for the shared select + verify + accept step."""
    name: str = ""
    record_picks: bool = False  # record the target routers' picks per drafted node (the selector's expert term)

    @abstractmethod
    def propose_tree(self, seqs: list[Sequence], gammas: list[int], width: int, noise: dict[int, torch.Tensor],
                     hook: DraftHook | None = None) -> list[DraftTree]:
        """A draft tree per sequence (`tree.DraftTree`): depth ≤ gammas[b], at most width · gammas[b] nodes,
        the children of a node distinct tokens (or, for unseeded sampled rows, independent draws from one q).
        Greedy rows: any tokens (exact-match acceptance); seeded sampled rows b: any tokens (`noise[b]`
        [γ_b+1, V] is the coupled rule's noise, for drafters that sample); unseeded sampled rows: tokens drawn
        from the tree's q. Must leave the KV cache's committed lengths as they were."""

    def available(self, seqs: list[Sequence], limits: list[int]) -> list[int]:
        """The most tokens this drafter can propose per sequence now (at most limits[b]); a model drafter can
        always draft up to the limit, a lookup only as far as its match goes."""
        return list(limits)

    def sync(self, seqs: list[Sequence]) -> None:
        """Before a draft phase in which these sequences draft: read what was committed since this drafter last
        drafted for them, all but the last position, where it is longer than what a step drafting every step
        leaves (an EAGLE head: the prompt, the positions plain steps committed), so the draft phase runs what a
        steady one runs. The decoder calls it apart from the draft phase: a sequence that never drafts with this
        drafter never pays it, and a configuration's measured rate is not charged for the backlog of the steps
        before it."""

    def catchup(self, seqs: list[Sequence]) -> list[int]:
        """Entries per sequence the drafter's first forward would run now, `sync` included (1: the pending token
        alone; a head with its own KV cache, more where it missed committed positions). The controller prices a
        step's draft by them (`sync` is timed with the drafter's draft)."""
        return [1] * len(seqs)

    def prepare(self) -> None:
        """Before this drafter's draft phase (untimed as drafting: one-time setup)."""

    @property
    def needs_setup(self) -> bool:
        """`prepare` will do setup work (load or pin something) before the next draft phase."""
        return False

    def draft_set(self) -> DraftSet | None:
        """The target experts this drafter keeps resident while it drafts (None: none); the controller prices the
        verification's misses and the setup with them."""
        return None

    def idle(self) -> None:
        """A step this drafter sat out."""

    def retire(self, live: set[int]) -> None:
        """Drop per-sequence state of sequences not in `live` (seq ids)."""

    def target_observers(self) -> list:
        """The runner observers this drafter registered (left out of forwards it takes no part in)."""
        return []

    def compacted(self, seqs: list[Sequence], paths: list[list[int]], lengths: list[int]) -> None:
        """A step moved each sequence's accepted tree path (verification rows paths[b], at lengths[b] + row) onto
        consecutive positions (per-position state the drafter keeps follows)."""

    def begin_verify(self) -> None:
        """Right before a verification forward with rows this drafter proposed."""

    def end_verify(self) -> None:
        """Right after that forward."""

    @property
    def prefetch_bytes(self) -> int:
        """Bytes this drafter started loading in the background for the verification (not draft-phase bytes)."""
        return 0

    @property
    def refresh_s(self) -> float:
        """Seconds `end_verify` spent so far (the step breakdown's draft-set refresh)."""
        return 0.0

    @abstractmethod
    def stats(self) -> dict:
        """The drafter's own counters for `llm.stats` (always its `drafter` name)."""


def siblings(s: Sequence, logits: torch.Tensor, chosen: int, n: int, noise: torch.Tensor | None,
             q: torch.Tensor | None) -> list[int]:
    """Up to n more children of a tree node beside `chosen`, from the draft's logits [V] at that node: greedy rows
    the next most likely tokens, seeded rows the next best of log q + g (the coupled rule's noise), unseeded
    rows n more independent draws from q (as multi-draft rejection sampling needs)."""
    if n <= 0:
        return []
    if q is not None:
        return torch.multinomial(q, n, replacement=True, generator=s.generator).tolist()
    score = logits.float() if noise is None else torch.log(probs_from_logits(logits, s.params)) + noise
    top = torch.topk(score, min(n + 1, score.numel()))
    return [t for v, t in zip(top.values.tolist(), top.indices.tolist()) if t != chosen and v != float("-inf")][:n]


class RowPicks:
    """The draft tokens of the rows that do not take the argmax, at each depth of a model drafter's chain:
    seeded sampled rows b take the coupled pick with `noise[b]`, unseeded sampled rows draw from q (kept as
    `q` [B, G, V] for acceptance; None until such a row drafts). Greedy rows keep the argmax."""

    def __init__(self, seqs: list[Sequence], G: int, noise: dict[int, torch.Tensor]):
        self.seqs, self.G, self.noise = seqs, G, noise
        self.q: torch.Tensor | None = None
        self.sampled = any(not s.params.greedy for s in seqs)

    def apply(self, j: int, rows: list[int], logits: torch.Tensor, nxt: torch.Tensor, *, by_row: bool) -> None:
        """Overwrite `nxt` for the sampled rows among `rows` (batch rows drafting at depth j). `logits` / `nxt` are
        indexed by batch row (by_row) or by position in `rows`."""
        for i, b in enumerate(rows):
            s = self.seqs[b]
            if s.params.greedy:
                continue
            k = b if by_row else i
            if b in self.noise:
                nxt[k] = coupled_pick(logits[k], s.params, self.noise[b][j])
                continue
            if self.q is None:
                self.q = torch.zeros(len(self.seqs), self.G, logits.shape[-1], device=logits.device)
            self.q[b, j] = probs_from_logits(logits[k], s.params)
            nxt[k] = torch.multinomial(self.q[b, j], 1, generator=s.generator)[0]


def chain_trees(seqs: list[Sequence], gammas: list[int], chain: list[list[int]] | None, width: int,
                seen: dict[int, tuple[list[int], torch.Tensor]], noise: dict[int, torch.Tensor],
                q: torch.Tensor | None) -> list[tuple[list[int], list[int], list[torch.Tensor], list[int], int]]:
    """Each row's draft tree from its chain (chain[b][j]; None: placeholders, the tokens stay on the device) plus
    up to width − 1 sibling leaves per depth from the draft's logits there (`seen[j]` = (rows, logits [len(rows),
    V])). Per row: (tokens, parents, q rows of its unseeded nodes, the chain's node index per depth, siblings)."""
    out = []
    for b, (s, g) in enumerate(zip(seqs, gammas)):
        tokens, parents, qrows, chain_nodes, n_sib, prev = [], [], [], [], 0, -1
        unseeded = not s.params.greedy and b not in noise
        for j in range(g):
            tok = chain[b][j] if chain is not None else 0
            sib = []
            if width > 1:
                rows, logits = seen[j]
                sib = siblings(s, logits[rows.index(b)], tok, width - 1, noise[b][j] if b in noise else None,
                               q[b, j] if unseeded else None)
            here = len(tokens)
            chain_nodes.append(here)
            for t in [tok] + sib:
                tokens.append(t)
                parents.append(prev)
                if unseeded:
                    qrows.append(q[b, j])
            n_sib += len(sib)
            prev = here  # the chain continues from its own node (siblings are leaves)
        out.append((tokens, parents, qrows, chain_nodes, n_sib))
    return out
