"""SpecMoE's self draft behind the `Drafter` interface (`drafter="self"`).

The chain (`draft`): the model restricted to its pinned draft experts (`draft.DraftExperts`), one draft
forward per depth, all sequences batched. Each draft forward writes K/V at the sequence's next position;
cache lengths are advanced while drafting and set back afterwards, so the draft's K/V at positions ≥ the
committed length are scratch (overwritten by verification). The draft never calls the expert store: zero
backing-tier bytes. A tree (width > 1) adds, at every depth j, up to width − 1 siblings of the chain's node
j, read from the same draft logits without any further forward (`drafters.siblings`). Siblings are leaves:
the tree costs exactly the chain's draft forwards and widens only the verification.

For the cost-aware selector's expert term (EcoSpec), when `record_picks` is set each draft forward j records
the target routers' top-k picks on the draft's hidden states before substitution (`DraftExperts.pick_log`):
forward 0 sees the pending token (`DraftTree.root_experts`), forward j the chain node at depth j
(`DraftTree.experts`). The chain's last node and every sibling leaf are never forwarded by the draft; their
experts stay unknown (None) and the selector prices them by the layers' recent routing frequency.

Around verification (`begin_verify` / `end_verify`) the draft set counts the target's routing and refreshes
(HotTemporal). A stretch of steps without the self draft (`idle`) gives the draft set's pinned slots back;
the next `prepare` pins it again. With `draft_prefetch`, the draft's router picks start loads while it
drafts, scored against what verification needed (precision / recall in the stats).
"""
from __future__ import annotations

import torch

from specmoe.decoding.drafters.draft_experts import DraftExperts
from specmoe.decoding.drafters.base import Drafter, DraftHook, DraftSet, RowPicks, chain_trees
from specmoe.decoding.runtime.runner import ModelRunner
from specmoe.decoding.runtime.sequence import Sequence
from specmoe.decoding.trees.tree import DraftTree

# B=sequences, G=max drafted tokens, V=vocab


@torch.inference_mode()
def draft(runner: ModelRunner, drafter: DraftExperts, seqs: list[Sequence], gammas: list[int],
          noise: dict[int, torch.Tensor] | None = None, on_logits=None):
    """Draft gammas[b] tokens for each sequence: greedy rows take the argmax, seeded sampled rows b the
    coupled pick with `noise[b]` [γ_b+1, V], unseeded sampled rows draw from q with their own generator.
    Returns (draft ids [B, G] on the device, q [B, G, V] of the unseeded sampled rows or None when there
    are none). Cache lengths are unchanged on return. `on_logits(j, rows, logits [len(rows), V])`, when
    given, sees each draft position and may lower `gammas[b]` (in place) to j+1 for greedy rows b in rows:
    those rows stop drafting after this token (the controller's stopping rule)."""
    cache, dev = runner.cache, runner.device
    noise = noise or {}
    B, G = len(seqs), max(gammas)
    out = torch.zeros(B, G, dtype=torch.long, device=dev)
    if G == 0:
        return out, None
    base = [cache.lengths[s.slot] for s in seqs]
    picks = RowPicks(seqs, G, noise)
    tok = torch.tensor([[s.output_ids[-1]] for s in seqs], device=dev)  # [B, 1]
    ctx = drafter.context()
    try:
        for j in range(G):
            rows = [b for b in range(B) if gammas[b] > j]
            if not rows:
                break
            sub = [seqs[b] for b in rows]
            bv = runner.batch_view([s.slot for s in sub], [1] * len(sub))
            idx = None if len(rows) == B else torch.tensor(rows, device=dev)
            logits = runner.model(tok if idx is None else tok[idx], cache, bv, ctx, flat=True)  # [b, V]
            logits = logits if logits.dtype == torch.float32 else logits.float()
            drafter.forwards += 1
            nxt = logits.argmax(-1)  # [b]
            if on_logits is not None:
                on_logits(j, rows, logits)
            if picks.sampled:
                picks.apply(j, rows, logits, nxt, by_row=False)
            if idx is None:
                out[:, j] = nxt
                tok = nxt[:, None]
            else:
                out[idx, j] = nxt
                tok = tok.clone()
                tok[idx, 0] = nxt
            for s in sub:
                runner.commit(s, 1)
    finally:
        for s, length in zip(seqs, base):
            runner.rollback(s, length)
        runner.expert_s += ctx.expert_s
    return out, picks.q



class SelfDrafter(Drafter):
    name = "self"
    IDLE_AFTER = 4  # steps without the self draft after which its draft set's slots are given back

    def __init__(self, runner: ModelRunner, experts: DraftExperts):
        self.runner, self.experts = runner, experts
        runner.observers.append(experts.observe)
        self.record_picks = False  # the cost-aware selector's expert term reads the draft's router picks
        self.siblings = 0  # tree nodes beyond the chain proposed
        self.idle_steps, self.dormant, self.unpins = 0, False, 0
        self.last_counts: dict[int, list[int]] = {}
        self.picks = None
        self.pf = {"tp": 0, "fp": 0, "fn": 0}  # draft-guided prefetch picks vs what verification needed
        if experts.prefetch:
            runner.observers.append(self._observe)

    def target_observers(self) -> list:
        return [self.experts.observe] + ([self._observe] if self.experts.prefetch else [])

    @property
    def needs_setup(self) -> bool:
        """The next draft phase first makes the draft set resident (first use, or after an idle stretch)."""
        return not self.experts.ready or self.dormant

    def draft_set(self) -> DraftSet:
        ex = self.experts
        return DraftSet(dict(ex.ids) if ex.ready else None, ex.n, self.needs_setup)

    def prepare(self) -> None:
        if not self.experts.ready:
            self.experts.setup()
        elif self.dormant:
            self.experts.repin()  # the draft reads its experts in place: they must be resident, in known slots
            self.dormant = False
        self.idle_steps = 0

    def idle(self) -> None:
        """A step without the self draft; a long stretch unpins the draft set (its slots serve the cache)."""
        self.idle_steps += 1
        if self.idle_steps >= self.IDLE_AFTER and self.experts.ready and not self.dormant:
            for layer in self.experts.cfg.draft_layers:
                self.runner.provider.pin(layer, [])
            self.dormant, self.unpins = True, self.unpins + 1

    @torch.inference_mode()
    def propose_tree(self, seqs: list[Sequence], gammas: list[int], width: int, noise: dict[int, torch.Tensor],
                     hook: DraftHook | None = None) -> list[DraftTree]:
        seen: dict[int, tuple[list[int], torch.Tensor]] = {}
        raw: dict[int, tuple] = {}  # depth j → (rows, layers, router ids [rows, layers, K] on the device)
        log = self.experts.pick_log = [] if self.record_picks else None

        def keep(j, rows, logits):  # the draft's logits at depth j + 1 for the sequences in `rows`
            if width > 1:
                seen[j] = (list(rows), logits)
            if log:
                raw[j] = (list(rows), [layer for layer, _ in log], torch.stack([i for _, i in log], 1))
                log.clear()
            if hook is not None:
                hook(j, rows, logits)
        try:
            drafts, q = draft(self.runner, self.experts, seqs, gammas, noise, on_logits=keep)
        finally:
            self.experts.pick_log = None
        if self.experts.prefetch:
            self.picks = {layer: (set(w), set(self.experts.ids[layer]))
                          for layer, w in self.experts.prefetch_want.items()}
        picks = self._picks(raw) if raw else {}
        # a chain's tokens stay on the device (the verification input is built there, `accept` reads them)
        deferred = width == 1
        chain = drafts.tolist() if not deferred else None
        trees = []
        for b, (tokens, parents, qrows, nodes, n_sib) in enumerate(chain_trees(seqs, gammas, chain, width, seen,
                                                                               noise, q)):
            self.siblings += n_sib
            ex = None
            if picks:  # the chain node at depth j: the target's picks of draft forward j + 1
                ex = [None] * len(tokens)
                for j, k in enumerate(nodes):
                    ex[k] = picks.get(j + 1, {}).get(b)
            trees.append(DraftTree(tokens, parents, torch.stack(qrows) if qrows else None, ex,
                                   picks.get(0, {}).get(b), src=(drafts, b) if deferred and gammas[b] else None))
        return trees

    @staticmethod
    def _picks(raw: dict[int, tuple]) -> dict[int, dict[int, frozenset]]:
        """depth j → row b → the (layer, expert) pairs the target's routers picked for b's depth-j token
        (one host read for the whole draft phase)."""
        flat = torch.cat([ids.reshape(-1) for _, _, ids in raw.values()]).tolist()
        out, at = {}, 0
        for j, (rows, layers, ids) in raw.items():
            K = ids.shape[-1]
            for b in rows:
                es = flat[at:at + len(layers) * K]
                out.setdefault(j, {})[b] = frozenset((layers[i // K], e) for i, e in enumerate(es))
                at += len(layers) * K
        return out

    # ------------------------------------------------------------ around verification
    def _observe(self, layer: int, routing) -> None:
        self.last_counts[layer] = routing.counts_host  # draft-guided prefetch only: a cache reads it anyway

    def begin_verify(self) -> None:
        self.last_counts = {}
        self.experts.begin_target()

    def end_verify(self) -> None:
        self.experts.end_target()
        if self.picks is not None:
            self._score_prefetch(self.picks)
            self.picks = None

    @property
    def refresh_s(self) -> float:
        return self.experts.refresh_s

    @property
    def prefetch_bytes(self) -> int:
        return self.experts.prefetch_bytes

    def _score_prefetch(self, picks: dict) -> None:
        """Draft-guided prefetch's prediction (the target routers' picks on drafted tokens, outside the draft
        set) against what verification needed outside the draft set, per layer."""
        for layer, counts in self.last_counts.items():
            want, dset = picks.get(layer, (set(), set(self.experts.ids.get(layer, ()))))
            need = {e for e, c in enumerate(counts) if c} - dset
            self.pf["tp"] += len(want & need)
            self.pf["fp"] += len(want - need)
            self.pf["fn"] += len(need - want)

    def stats(self) -> dict:
        e = self.experts
        st = {"drafter": self.name, **e.stats(), "tree_sibling_nodes": self.siblings, "draft_experts": e.n,
              "substitution": e.substitution, "draft_policy": e.policy, "draft_set_unpins": self.unpins}
        if e.prefetch:
            tp, fp, fn = self.pf["tp"], self.pf["fp"], self.pf["fn"]
            st["draft_prefetch_precision"] = tp / (tp + fp) if tp + fp else None
            st["draft_prefetch_recall"] = tp / (tp + fn) if tp + fn else None
        return st
