"""SpecMoE's self draft behind the `Drafter` interface (`drafter="self"` with `draft_tree=True`).

The chain is `specmoe.draft`'s (the model restricted to its pinned draft experts, one draft forward per
depth, all sequences batched). A tree adds, at every depth j, up to width − 1 siblings of the chain's node
j, read from the same draft logits without any further forward: greedy rows the next most likely tokens,
seeded rows the next best of log q + g (the coupled rule's noise of that output position), unseeded rows
width − 1 more independent draws from q (so a node's children are i.i.d. draws from one q, as multi-draft
rejection sampling needs). Siblings are leaves: the tree costs exactly the chain's draft forwards and widens
only the verification.

For the cost-aware selector (EcoSpec's expert term), each draft forward j records the target routers' top-k
picks on the draft's hidden states before substitution (`DraftExperts.pick_log`): forward 0 sees the pending
token (`DraftTree.root_experts`), forward j the chain node at depth j (`DraftTree.experts`). The chain's last
node and every sibling leaf are never forwarded by the draft; their experts stay unknown (None) and the
selector prices them by the layers' recent routing frequency (an expectation, see `treeselect`). Using
the parent's picks instead would price every leaf at zero new experts once its parent is selected, which is
exactly the leaves that pull unpredicted experts into the verification.

The verification forward is bracketed by the draft set's `begin_target` /
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
        raw: dict[int, tuple] = {}  # depth j → (rows, layers, router ids [rows, layers, K] on the device)
        log = self.experts.pick_log = []

        def keep(j, rows, logits):  # the draft's logits at depth j + 1 for the sequences in `rows`
            seen[j] = (list(rows), logits.clone())
            if log:
                raw[j] = (list(rows), [layer for layer, _ in log], torch.stack([i for _, i in log], 1))
                log.clear()
        try:
            drafts, q = draft(self.runner, self.experts, seqs, gammas, noise, on_logits=keep)
        finally:
            self.experts.pick_log = None
        picks = self._picks(raw, drafts)
        chain = drafts.tolist()
        trees = []
        for b, (s, g) in enumerate(zip(seqs, gammas)):
            tokens, parents, qrows, ex = [], [], [], []
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
                    ex.append(picks.get(j + 1, {}).get(b) if k == 0 else None)  # the chain node: forward j + 1
                    if unseeded:
                        qrows.append(q[b, j])
                self.siblings += len(sib)
                prev = here  # the chain continues from its own node (siblings are leaves)
            trees.append(DraftTree(tokens, parents, torch.stack(qrows) if qrows else None, ex,
                                   picks.get(0, {}).get(b)))
        return trees

    @staticmethod
    def _picks(raw: dict[int, tuple], drafts: torch.Tensor) -> dict[int, dict[int, frozenset]]:
        """depth j → row b → the (layer, expert) pairs the target's routers picked for b's depth-j token
        (one host read for the whole draft phase)."""
        if not raw:
            return {}
        flat = torch.cat([ids.reshape(-1) for _, _, ids in raw.values()]).tolist()
        out, at = {}, 0
        for j, (rows, layers, ids) in raw.items():
            K = ids.shape[-1]
            for b in rows:
                es = flat[at:at + len(layers) * K]
                out.setdefault(j, {})[b] = frozenset((layers[i // K], e) for i, e in enumerate(es))
                at += len(layers) * K
        return out

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
