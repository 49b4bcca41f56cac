"""ModelRunner: turns lists of sequences and their new tokens into one batched forward.

It owns the model, the KV cache and the expert provider. A forward writes the new
tokens' keys/values at positions `cache.lengths[slot] + t`; committing (advancing
lengths) is the caller's decision, which is what makes speculative rollback free.
"""
from __future__ import annotations

import contextlib

import torch

from specmoe.decoding.runtime.sequence import Sequence
from specmoe.models.decoder import BatchView, Transformer
from specmoe.models.kv_cache import KVCache
from specmoe.models.moe import ForwardContext

# B=batch, T=new tokens per sequence (padded), V=vocab


class ModelRunner:
    def __init__(self, model: Transformer, provider, cache: KVCache, device: torch.device):
        self.model, self.provider, self.cache, self.device = model, provider, cache, device
        self.observers: list = []    # called for every forward (telemetry, HotTemporal counts)
        self.expert_s = 0.0          # seconds in routed experts over every forward (step breakdown)
        self.layer_hooks: list = []  # called at the start of each MoE layer (prefetch)
        self._record: dict | None = None  # see recording()
        # EAGLE drafters: `sink.capture` (target layers, see ForwardContext.capture_hidden) and
        # `sink.take(seqs, starts, lens, hidden)` after every forward, with the positions it wrote
        self.hidden_sinks: list = []

    @contextlib.contextmanager
    def recording(self, on: bool, into: dict):
        """While `on`, every forward keeps its logits per sequence in `into` (seq_id → [T, V] or [V], as
        returned); a later forward over the same sequence replaces the entry (the engine's logprobs)."""
        prev, self._record = self._record, (into if on else None)
        try:
            yield
        finally:
            self._record = prev

    def context(self, routing_hook=None, observers=None) -> ForwardContext:
        return ForwardContext(provider=self.provider, routing_hook=routing_hook,
                              observers=list(self.observers) + list(observers or []),
                              layer_hooks=list(self.layer_hooks))

    @torch.inference_mode()
    def encode(self, seq: Sequence) -> None:
        """Encoder–decoder models: run the encoder over the sequence's source and keep its cross-attention K/V in
        the cache at its slot (the model's `encode`); its experts come through the provider, observed like a
        forward's."""
        ctx = self.context()
        try:
            self.model.encode(torch.tensor(seq.source_ids, device=self.device), self.cache, seq.slot, ctx)
        finally:
            self.expert_s += ctx.expert_s

    def batch_view(self, slots: list[int], new_lens: list[int]) -> BatchView:
        """Where the forward's tokens sit, built from the host's lengths in one upload: positions [B, T] and where
        their K/V go (see `KVCache.write_index`)."""
        B, T = len(slots), max(new_lens)
        starts = [self.cache.lengths[s] for s in slots]
        both = torch.tensor([[p + t for p in starts for t in range(T)], [s for s in slots for _ in range(T)]],
                            device=self.device)  # [2, B·T]: position and slot of each token
        valid = None
        if min(new_lens) != T:
            valid = torch.arange(T, device=self.device)[None, :] < torch.tensor(new_lens, device=self.device)[:, None]
        contiguous = slice(slots[0], slots[0] + B) if slots == list(range(slots[0], slots[0] + B)) else None
        key_len = max(p + n for p, n in zip(starts, new_lens))
        pos, slot = both
        return BatchView(slots=None if contiguous else torch.tensor(slots, device=self.device),
                         positions=pos.view(B, T), valid=valid, contiguous=contiguous, key_len=key_len,
                         write_index=(slot, pos), real_tokens=sum(new_lens), flat_positions=pos,
                         last_only=T == 1 and min(starts) == max(starts))

    @torch.inference_mode()
    def forward(self, seqs: list[Sequence], new_tokens: list[list[int]], *, ctx: ForwardContext | None = None,
                all_logits: bool = False) -> torch.Tensor:
        """Run the new tokens of each sequence. Returns logits [B, T, V] (all positions, padded) or
        [B, V] at each sequence's last new token. Does not advance cache lengths."""
        lens = [len(t) for t in new_tokens]
        T = max(lens)
        tokens = torch.tensor([t + [0] * (T - len(t)) for t in new_tokens], device=self.device)  # [B, T]
        return self.forward_padded(seqs, tokens, lens, ctx=ctx, all_logits=all_logits)

    @torch.inference_mode()
    def forward_padded(self, seqs: list[Sequence], tokens: torch.Tensor, lens: list[int], *,
                       ctx: ForwardContext | None = None, all_logits: bool = False,
                       view: BatchView | None = None) -> torch.Tensor:
        """`forward` over tokens already on the device: tokens [B, T], row b real for its first lens[b]
        positions (the rest is padding, whatever it holds). `view`: a prepared BatchView (token trees)."""
        bv = self.batch_view([s.slot for s in seqs], lens) if view is None else view
        ctx = ctx or self.context()
        if self.hidden_sinks:
            ctx.capture_hidden = tuple(sorted({i for sink in self.hidden_sinks for i in sink.capture}))
            starts = [self.cache.lengths[s.slot] for s in seqs]
        try:
            if all_logits or tokens.shape[1] == 1:
                out = self.model(tokens, self.cache, bv, ctx, flat=not all_logits)  # [B, T, V] or [B, V]
                out = out if out.dtype == torch.float32 else out.float()
            else:
                last = torch.tensor(lens, device=self.device)[:, None] - 1  # [B, 1]
                out = self.model(tokens, self.cache, bv, ctx, logits_at=last)[:, 0].float()  # [B, V]
        finally:
            self.expert_s += ctx.expert_s
        for sink in self.hidden_sinks:
            sink.take(seqs, starts, lens, ctx.hidden)
        if self._record is not None:
            self._record.update({s.seq_id: out[b] for b, s in enumerate(seqs)})
        return out

    def tree_view(self, seqs: list[Sequence], lens: list[int], depths: torch.Tensor, tree: torch.Tensor) -> BatchView:
        """The BatchView of a token-tree verification: row b's token t (t < lens[b]) at RoPE position
        length + depths[b, t], writing its K/V at length + t, seeing the prefix and tree[b, t] ([B, T, T])."""
        bv = self.batch_view([s.slot for s in seqs], lens)
        bv.write_positions, bv.positions, bv.tree = bv.positions, bv.positions[:, :1] + depths, tree
        bv.flat_positions = None  # RoPE at the new positions; the K/V places (write_index) stay start + t
        return bv

    def rerecord(self, seqs: list[Sequence], rows: list[list[int]], logits: torch.Tensor) -> None:
        """While recording: keep, per sequence, the logits rows[b] of logits [B, T, V] (a tree's accepted
        path, in emission order) instead of the forward's rows."""
        if self._record is not None:
            self._record.update({s.seq_id: logits[b, r] for b, (s, r) in enumerate(zip(seqs, rows))})

    def commit(self, seq: Sequence, n: int) -> None:
        """Advance the sequence's committed length by n: its K/V up to there and, for a model with linear
        attention, the recurrent states the cache kept for that length (`models.linear_state`) are what the
        next forward continues from."""
        self.cache.lengths[seq.slot] += n

    def rollback(self, seq: Sequence, length: int) -> None:
        assert length <= self.cache.lengths[seq.slot], "rollback can only shorten a sequence"
        self.cache.lengths[seq.slot] = length
