"""The `eagle` drafter: an EAGLE head (`specmoe.models.eagle`) drafts from the target's own features.

Bookkeeping per sequence (committed target length L: the KV cache holds positions 0..L-1, the pending token
is x_L):

- the runner hands every forward's captured target features to `take` (`ModelRunner.hidden_sinks`): prefill
  gives positions 0..P-1, a verification forward the pending token's and the drafts' positions; only those
  below the committed length are used (a rejected draft's feature is overwritten by the next forward at the
  same position);
- head entry t reads (x_{t+1}, feature t) and predicts feature t+1; the head's KV cache holds entries
  0..h-1 (h = L after every proposal). A proposal first runs the entries h..L-1 (the positions committed
  since the last one; all rows in one ragged forward), whose last output scores draft 1; each further draft
  is one forward of one entry per row (the previous draft and the head's own predicted feature). Draft
  entries sit past L: scratch, overwritten next time (rolling back is a length change).

Greedy rows draft the argmax, seeded sampled rows the coupled pick with the step's noise, unseeded sampled
rows draw from q = the head's distribution; the shared acceptance rule keeps the target's output (the head
only proposes). No expert bytes move while drafting: the head is dense and small.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from specmoe.decoding.drafters.base import Drafter, DraftHook, RowPicks, chain_trees
from specmoe.decoding.runtime.runner import ModelRunner
from specmoe.decoding.runtime.sequence import Sequence
from specmoe.decoding.trees.tree import DraftTree
from specmoe.models.decoder import BatchView
from specmoe.models.eagle import EagleHead
from specmoe.models.kv_cache import KVCache

# B=sequences, N=entries per row in one head forward, D=hidden, F=feature width, V=vocab


@dataclass
class _Track:
    """One sequence's features not yet read by the head: positions [start, start + n) in buf's first n rows (a
    buffer grown by doubling, so a sequence that does not draft with the head for a while costs one row write
    per token, not a copy of its history)."""
    seq: Sequence
    start: int = 0
    buf: torch.Tensor | None = None  # [capacity, F]
    n: int = 0
    head_len: int = 0  # head entries 0..head_len-1 hold K/V

    def put(self, at: int, new: torch.Tensor) -> None:
        """Features of positions at .. at + len(new) - 1 (those from `at` on replace what was held)."""
        if self.buf is None:
            self.start, self.buf, self.n = at, new.new_empty(max(16, 2 * new.shape[0]), new.shape[1]), 0
        keep = at - self.start
        if not 0 <= keep <= self.n:
            raise RuntimeError(f"eagle drafter: features of sequence {self.seq.seq_id} arrived out of order "
                               f"(at {at}, holding {self.start}..{self.start + self.n})")
        need = keep + new.shape[0]
        if need > self.buf.shape[0]:
            grown = self.buf.new_empty(max(need, 2 * self.buf.shape[0]), self.buf.shape[1])
            grown[:keep] = self.buf[:keep]
            self.buf = grown
        self.buf[keep:need] = new
        self.n = need

    def rows(self, a: int, b: int) -> torch.Tensor:
        """Features of positions a .. b - 1."""
        return self.buf[a - self.start: b - self.start]

    def drop_before(self, pos: int) -> None:
        k = pos - self.start
        if k > 0:
            self.buf[: self.n - k] = self.buf[k: self.n].clone()
            self.n, self.start = self.n - k, pos

    def move(self, pairs: list[tuple[int, int]]) -> None:
        """Positions src → dst (a token tree's accepted path compacted onto consecutive positions)."""
        if pairs:
            src = torch.tensor([a - self.start for a, _ in pairs], device=self.buf.device)
            dst = torch.tensor([b - self.start for _, b in pairs], device=self.buf.device)
            self.buf[dst] = self.buf[src]


class EagleDrafter(Drafter):
    name = "eagle"

    def __init__(self, runner: ModelRunner, head: EagleHead, *, head_path: str | Path = ""):
        self.runner, self.head, self.head_path = runner, head, str(head_path)
        self.capture = head.hc.target_layers(runner.model.cfg.num_layers)
        runner.hidden_sinks.append(self)
        self.tracks: dict[int, _Track] = {}
        self.kv: KVCache | None = None
        self.head_forwards = self.catchup_entries = 0
        self.asked = self.proposed = 0

    # ------------------------------------------------------------ features from the target's forwards
    def take(self, seqs: list[Sequence], starts: list[int], lens: list[int], hidden: dict[int, torch.Tensor]) -> None:
        feats = torch.cat([hidden[i] for i in self.capture], dim=-1)  # [B, T, F]
        for b, s in enumerate(seqs):
            tr = self.tracks.get(s.seq_id)
            if tr is None or tr.seq is not s:  # a new sequence (ids may be reused across runs)
                tr = self.tracks[s.seq_id] = _Track(s, start=starts[b])
            tr.put(starts[b], feats[b, :lens[b]])

    def compacted(self, seqs: list[Sequence], paths: list[list[int]], lengths: list[int]) -> None:
        """A tree verification's accepted paths moved to consecutive positions: their features follow."""
        for s, path, L in zip(seqs, paths, lengths):
            tr = self.tracks.get(s.seq_id)
            if tr is not None and tr.buf is not None:
                tr.move([(L + r, L + k) for k, r in enumerate(path) if r != k])

    # ------------------------------------------------------------ drafting
    def _reserve(self) -> KVCache:
        c = self.runner.cache
        need_b, need_s = c.max_batch, c.max_seq + 1  # + 1: a scratch position the padding entries write
        if self.kv is None:
            p = next(self.head.parameters())
            self.kv = self.head.new_cache(need_b, need_s, p.dtype, p.device)
        else:
            self.kv.reserve(need_b, need_s)
        return self.kv

    def _forward(self, slots: list[int], tokens: torch.Tensor, feats: torch.Tensor, starts: list[int],
                 lens: list[int]) -> torch.Tensor:
        """Head entries starts[b] .. starts[b]+lens[b]-1 of each row → the head's output at each row's last
        entry [B, D]. Padding entries write at the scratch position (never a real entry's)."""
        kv, dev = self.kv, self.runner.device
        B, N = tokens.shape
        st = torch.tensor(starts, device=dev)
        ar = torch.arange(N, device=dev)[None, :]
        sl = torch.tensor(slots, device=dev)
        ragged = any(m != N for m in lens)
        if ragged:
            n = torch.tensor(lens, device=dev)
            real = ar < n[:, None]
            positions = torch.where(real, st[:, None] + ar, st[:, None])  # padding: attends like the first entry
        else:  # every row has N entries (each draft step: one): no padding to direct to the scratch position
            positions = st[:, None] + ar
        bv = BatchView(slots=sl, positions=positions, key_len=max(s + m for s, m in zip(starts, lens)),
                       contiguous=slice(slots[0], slots[0] + B) if slots == list(range(slots[0], slots[0] + B))
                       else None)
        bv.write_index = kv.write_index(sl, positions)
        if ragged:
            scratch = sl[:, None] * kv.max_seq + (kv.max_seq - 1)
            bv.write_index = torch.where(real, bv.write_index.view(B, N), scratch).reshape(-1)
        m = self.runner.model
        out = self.head(F.embedding(tokens, m.embed.weight), feats.to(m.embed.weight.dtype), kv, bv)
        self.head_forwards += 1
        return out[torch.arange(B, device=dev), n - 1] if ragged else out[:, -1]  # [B, D]

    def prepare(self) -> None:
        self._reserve()  # the head's KV cache follows the target's (allocated on first use: setup, not drafting)

    def catchup(self, seqs: list[Sequence]) -> list[int]:
        """Head entries the next proposal's first forward runs per sequence: the positions committed since the
        head last drafted for it (1 when it drafted every step)."""
        out = []
        for s in seqs:
            tr = self.tracks.get(s.seq_id)
            L = self.runner.cache.lengths[s.slot]
            out.append(max(1, L - tr.head_len) if tr is not None and tr.seq is s else L)
        return out

    def retire(self, live: set[int]) -> None:
        for sid in [k for k in self.tracks if k not in live]:
            del self.tracks[sid]

    def _catch_up(self, seqs: list[Sequence], upto: list[int]) -> torch.Tensor:
        """Run head entries head_len .. upto[b] - 1 of every sequence (their features came from the target's
        forwards; all rows in one ragged forward) → the head's output at each row's last entry [B, D]."""
        dev = self.runner.device
        toks, fts, starts, lens = [], [], [], []
        for s, L in zip(seqs, upto):
            tr = self.tracks.get(s.seq_id)
            if tr is None or tr.seq is not s or tr.buf is None:
                raise RuntimeError(f"eagle drafter: no target features for sequence {s.seq_id} (its prefill did "
                                   "not run through this drafter's runner)")
            h = tr.head_len
            ids = (s.prompt_ids + s.output_ids)[h + 1: L + 1]  # x_{t+1} for entries t = h .. L-1
            toks.append(ids)
            fts.append(tr.rows(h, L))
            starts.append(h)
            lens.append(L - h)
            if L - h < 1 or fts[-1].shape[0] != L - h:
                raise RuntimeError(f"eagle drafter: features of positions {h}..{L - 1} of sequence {s.seq_id} "
                                   "were not captured")
        N = max(lens)
        self.catchup_entries += sum(lens)
        tokens = torch.tensor([t + [0] * (N - len(t)) for t in toks], dtype=torch.long, device=dev)
        feats = torch.stack([F.pad(f, (0, 0, 0, N - f.shape[0])) for f in fts])
        x = self._forward([s.slot for s in seqs], tokens, feats, starts, lens)  # [B, D]
        for s, L in zip(seqs, upto):
            tr = self.tracks[s.seq_id]
            tr.drop_before(L)
            tr.head_len = L
        return x

    BACKLOG = 256  # positions a sequence's features may wait unread before `idle` reads them (bounds the memory)
    # positions a sequence may have waiting for the proposal's own first forward to read with its pending one (a
    # step drafting every step leaves at most γ: what its verification accepted); `sync` reads longer backlogs
    SYNC_ABOVE = 8

    @torch.inference_mode()
    def sync(self, seqs: list[Sequence], above: int | None = None) -> None:
        """The head reads the positions committed since it last drafted for these sequences (a prompt, plain
        steps' positions), all but the last committed one, which the proposal reads and drafts from: for the
        sequences with more than `above` (`SYNC_ABOVE`) such positions. A shorter backlog, what a step that drafts
        every step leaves, is read in the proposal's first forward (one forward, not two)."""
        above = self.SYNC_ABOVE if above is None else above
        L = [self.runner.cache.lengths[s.slot] for s in seqs]
        todo = [(s, n - 1) for s, n in zip(seqs, L) if s.seq_id in self.tracks and self.tracks[s.seq_id].seq is s
                and n - 1 - self.tracks[s.seq_id].head_len > above]
        if todo:
            self._reserve()
            self._catch_up([s for s, _ in todo], [n for _, n in todo])

    def idle(self) -> None:
        """A step the head sat out: sequences whose unread features passed `BACKLOG` positions are read now (a
        sequence decoded by plain steps for long would otherwise hold a feature row per position)."""
        L = self.runner.cache.lengths
        over = [t.seq for t in self.tracks.values()
                if t.buf is not None and L[t.seq.slot] - 1 - t.head_len > self.BACKLOG]
        if over:
            self.sync(over, 0)

    @torch.inference_mode()
    def propose_tree(self, seqs: list[Sequence], gammas: list[int], width: int, noise: dict[int, torch.Tensor],
                     hook: DraftHook | None = None) -> list[DraftTree]:
        """A chain per sequence (width 1), or the chain plus up to width − 1 siblings per depth from the head's
        logits at that depth (`drafters.siblings`; leaves, no extra head forward)."""
        r, dev = self.runner, self.runner.device
        self._reserve()
        B, G = len(seqs), max(gammas, default=0)
        # 1. the entries committed since the last proposal
        slots = [s.slot for s in seqs]
        x = self._catch_up(seqs, [r.cache.lengths[s.slot] for s in seqs])  # [B, D]
        # 2. the drafts: one entry per row per step (the previous draft, the head's own feature)
        out = torch.zeros(B, G, dtype=torch.long, device=dev)
        picks = RowPicks(seqs, G, noise)
        head_w = r.model.head_weight()
        pos = [r.cache.lengths[s.slot] for s in seqs]
        seen: dict[int, tuple[list[int], torch.Tensor]] = {}
        every = list(range(B))
        for j in range(G):
            rows = [b for b in range(B) if gammas[b] > j]
            if not rows:
                break
            if j > 0 and len(rows) == B:  # every row drafts on (the common case): no gather / scatter
                x = self._forward(slots, out[:, j - 1:j], x[:, None], [p + j - 1 for p in pos], [1] * B)
            elif j > 0:
                idx = torch.tensor(rows, device=dev)
                x = x.clone()
                x[idx] = self._forward([slots[b] for b in rows], out[idx, j - 1][:, None], x[idx][:, None],
                                       [pos[b] + j - 1 for b in rows], [1] * len(rows))
            # greedy rows: the argmax over the draft vocabulary (reduced: only its rows of the LM head)
            dl = self.head.draft_logits(x, head_w)  # [B, V'] (past γ: unused)
            nxt = self.head.to_target(dl.argmax(-1))  # [B]
            logits = None
            if width > 1 or any(not seqs[b].params.greedy for b in rows):
                logits = self.head.logits(x, head_w).float()  # [B, V], -inf outside the draft vocabulary
            if picks.sampled:
                picks.apply(j, rows, logits, nxt, by_row=True)
            out[rows, j] = nxt[rows]
            if width > 1:
                seen[j] = (every, logits)
            if hook is not None:  # the draft's confidence: the reduced vocabulary's softmax is the full one's
                hook(j, rows, dl[rows] if len(rows) < B else dl)
        asked = sum(gammas)
        self.asked += asked
        self.proposed += asked
        return [DraftTree(tokens, parents, torch.stack(qrows) if qrows else None)
                for tokens, parents, qrows, _, _ in chain_trees(seqs, gammas, out.tolist(), width, seen, noise,
                                                                picks.q)]

    def stats(self) -> dict:
        hc = self.head.hc
        return {"drafter": self.name, "eagle_head": self.head_path, "eagle_version": hc.version,
                "eagle_draft_vocab": hc.draft_vocab_size, "eagle_head_forwards": self.head_forwards,
                "eagle_catchup_entries": self.catchup_entries,
                "draft_tokens_asked": self.asked, "draft_tokens_proposed": self.proposed}
