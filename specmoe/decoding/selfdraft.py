"""SpecMoE's self draft behind the `Drafter` interface (`drafter="self"` with `draft_tree=True`).

The chain is `specmoe.draft`'s (the model restricted to its pinned draft experts, one draft forward per
depth, all sequences batched). A tree adds, at every depth j, up to width − 1 siblings of the chain's node
j, read from the same draft logits without any further forward: greedy rows the next most likely tokens,
seeded rows the next best of log q + g (the coupled rule's noise of that output position), unseeded rows
width − 1 more independent draws from q (so a node's children are i.i.d. draws from one q, as multi-draft
rejection sampling needs). Siblings are leaves: the tree costs exactly the chain's draft forwards and widens
only the verification. The verification forward is bracketed by the draft set's `begin_target` /
`end_target` (HotTemporal refresh from its routing), as in `SpecMoEDecoder`.
"""
from __future__ import annotations

import torch

from specmoe.decoding.draft import DraftExperts
from specmoe.decoding.drafters import Drafter, Proposal
from specmoe.decoding.runner import ModelRunner
from specmoe.decoding.sampling import probs_from_logits
from specmoe.decoding.sequence import Sequence
from specmoe.decoding.specmoe import draft
from specmoe.decoding.tree import DraftTree

# B=sequences, G=max drafted tokens, V=vocab


class SelfDrafter(Drafter):
    name = "self"

    def __init__(self, runner: ModelRunner, experts: DraftExperts):
        self.runner, self.experts = runner, experts
        runner.observers.append(experts.observe)
        self.siblings = 0  # tree nodes beyond the chain proposed

    def prepare(self) -> None:
        if not self.experts.ready:
            self.experts.setup()

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], gammas: list[int], noise: dict[int, torch.Tensor]) -> Proposal:
        self.prepare()
        drafts, q = draft(self.runner, self.experts, seqs, gammas, noise)
        return Proposal(drafts, q, list(gammas))

    @torch.inference_mode()
    def propose_tree(self, seqs: list[Sequence], gammas: list[int], width: int,
                     noise: dict[int, torch.Tensor]) -> list[DraftTree]:
        self.prepare()
        seen: dict[int, tuple[list[int], torch.Tensor]] = {}

        def keep(j, rows, logits):  # the draft's logits at depth j + 1 for the sequences in `rows`
            seen[j] = (list(rows), logits.clone())
        drafts, q = draft(self.runner, self.experts, seqs, gammas, noise, on_logits=keep)
        chain = drafts.tolist()
        trees = []
        for b, (s, g) in enumerate(zip(seqs, gammas)):
            tokens, parents, qrows = [], [], []
            unseeded = not s.params.greedy and b not in noise
            prev = -1
            for j in range(g):
                rows, logits = seen[j]
                lg = logits[rows.index(b)]
                sib = self._siblings(s, lg, chain[b][j], width - 1, noise[b][j] if b in noise else None,
                                     q[b, j] if unseeded else None)
                here = len(tokens)
                for k, tok in enumerate([chain[b][j]] + sib):
                    tokens.append(tok)
                    parents.append(prev)
                    if unseeded:
                        qrows.append(q[b, j])
                self.siblings += len(sib)
                prev = here  # the chain continues from its own node (siblings are leaves)
            trees.append(DraftTree(tokens, parents, torch.stack(qrows) if qrows else None))
        return trees

    @staticmethod
    def _siblings(s: Sequence, logits: torch.Tensor, chosen: int, n: int, noise: torch.Tensor | None,
                  q: torch.Tensor | None) -> list[int]:
        if n <= 0:
            return []
        if q is not None:  # unseeded: more independent draws from the same q
            return torch.multinomial(q, n, replacement=True, generator=s.generator).tolist()
        score = logits.float() if noise is None else torch.log(probs_from_logits(logits, s.params)) + noise
        top = torch.topk(score, min(n + 1, score.numel()))
        return [t for v, t in zip(top.values.tolist(), top.indices.tolist())
                if t != chosen and v != float("-inf")][:n]

    def begin_verify(self) -> None:
        self.experts.begin_target()

    def end_verify(self) -> None:
        self.experts.end_target()

    def stats(self) -> dict:
        return {"drafter": self.name, **self.experts.stats(), "tree_sibling_nodes": self.siblings}
