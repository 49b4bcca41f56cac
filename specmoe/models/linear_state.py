"""The recurrent state of linear-attention layers (Gated DeltaNet), kept so that speculation can roll it back.

A KV cache rolls back for free: keys past a sequence's committed length are masked and overwritten. A
recurrent state has no positions: it is one [heads, k_dim, v_dim] matrix (plus the conv's last inputs) that
every token updates. So each slot keeps a small ring of `ring` states per linear layer, indexed by sequence
length: ring row n mod `ring` holds the state after the first n tokens (the recurrent state and the conv state).
A forward that starts at a slot's committed length L reads row L mod ring and writes the states after each of
its tokens (L+1, L+2, ...). Committing n tokens is the KV cache's own length update (`KVCache.lengths`, the
runner's `commit`): the next forward reads the state kept for the new length, so after a verification of γ+1
tokens the state at each row's accepted length is the one that continues, and rejected drafts leave no trace.
That holds while a step writes fewer than `ring` positions past the committed length (ring = the strategy's
lookahead + 1, `for_lookahead`): a forward of fewer than `ring` tokens (decode, draft, verification) keeps the
state after each of its tokens; a longer one (a prefill, always committed whole) keeps each row's state after
its last token. A slot at length 0 (a new sequence) starts from zeros, whatever its ring holds.

Memory per sequence is constant in its length: ring × linear layers × (heads · k_dim · v_dim fp32 + conv
channels · (kernel - 1) in the compute dtype).
"""
from __future__ import annotations

import torch

from specmoe.config import ModelConfig
from specmoe.errors import MemoryBudgetError
from specmoe.memory import check_fits, fmt_bytes

# L=linear layers, Bmax=slots, W=ring, Hv=value heads, Dk/Dv=key/value head dims, C=conv channels, K=conv taps

_index_put = torch.ops.aten.index_put_


def for_lookahead(look: int) -> int:
    """Ring rows a strategy writing up to `look` positions past the committed length needs."""
    return max(2, look + 1)


def state_bytes(cfg: ModelConfig, dtype: torch.dtype, slots: int, ring: int) -> int:
    """Bytes of the linear layers' states for `slots` sequences with `ring` rows each (0 without linear layers)."""
    la = cfg.linear_attention
    if la is None or not cfg.linear_layers:
        return 0
    per_row = (la.num_v_heads * la.k_head_dim * la.v_head_dim * 4
               + la.conv_dim * (la.conv_kernel - 1) * torch.finfo(dtype).bits // 8)
    return len(cfg.linear_layers) * slots * ring * per_row


class LinearStates:
    """Per linear layer: the recurrent states [Bmax, W, Hv, Dk, Dv] (fp32, as transformers keeps them) and the
    conv states [Bmax, W, C, K-1] (compute dtype), ring row = sequence length mod W."""

    def __init__(self, cfg: ModelConfig, *, max_batch: int, ring: int, dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        self.cfg, self.la = cfg, cfg.linear_attention
        self.num_layers, self.ring, self.dtype, self.device = len(cfg.linear_layers), ring, dtype, torch.device(device)
        self.max_batch = 0
        self.rec: list[torch.Tensor] = []
        self.conv: list[torch.Tensor] = []
        self.reserve(max_batch)

    def bytes_for(self, slots: int) -> int:
        return state_bytes(self.cfg, self.dtype, slots, self.ring)

    @property
    def nbytes(self) -> int:
        return self.bytes_for(self.max_batch)

    def reserve(self, slots: int) -> None:
        """Hold at least `slots` slots, keeping every slot's states."""
        if slots <= self.max_batch:
            return
        la, W = self.la, self.ring
        what = (f"the linear-attention states ({slots} slot(s) × {W} ring rows × {self.num_layers} layers, "
                f"{fmt_bytes(self.bytes_for(slots))})")
        check_fits(what, self.bytes_for(slots), self.device)
        try:
            rec = [torch.zeros(slots, W, la.num_v_heads, la.k_head_dim, la.v_head_dim, device=self.device)
                   for _ in range(self.num_layers)]
            conv = [torch.zeros(slots, W, la.conv_dim, la.conv_kernel - 1, dtype=self.dtype, device=self.device)
                    for _ in range(self.num_layers)]
        except (RuntimeError, MemoryError) as e:
            raise MemoryBudgetError(f"{what} do not fit: {e}") from None
        for new, old in zip(rec + conv, self.rec + self.conv):
            new[: self.max_batch] = old
        self.rec, self.conv, self.max_batch = rec, conv, slots

    def row(self, lengths: torch.Tensor) -> torch.Tensor:
        """The ring row holding the state after `lengths` tokens (the commit rule: a slot continues from the
        state kept for its committed length)."""
        return lengths % self.ring

    def read(self, layer: int, slots: torch.Tensor, start: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(conv state [B, C, K-1], recurrent state [B, Hv, Dk, Dv] fp32) of each slot at length start[b]
        (zeros where start is 0: a new sequence)."""
        r = self.row(start)
        fresh = (start == 0)
        conv, rec = self.conv[layer][slots, r], self.rec[layer][slots, r]
        return (conv.masked_fill(fresh[:, None, None], 0),
                rec.masked_fill(fresh[:, None, None, None], 0))

    def write_recurrent(self, layer: int, slots: torch.Tensor, lengths: torch.Tensor, state: torch.Tensor,
                        keep: torch.Tensor | None = None) -> None:
        """Keep state[b] ([B, Hv, Dk, Dv]) as the state after lengths[b] tokens where keep[b] (None: every b)."""
        r = self.row(lengths)
        buf = self.rec[layer]
        _index_put(buf, [slots, r], state if keep is None else
                   torch.where(keep[:, None, None, None], state, buf[slots, r]))

    def write_conv(self, layer: int, slots: torch.Tensor, lengths: torch.Tensor, state: torch.Tensor,
                   keep: torch.Tensor | None = None) -> None:
        """Keep state[b, j] ([B, n, C, K-1]) as the conv state after lengths[b, j] tokens where keep[b, j]
        (None: every one; lengths distinct mod the ring within a row)."""
        r = self.row(lengths)  # [B, n]
        buf = self.conv[layer]
        s = slots[:, None].expand_as(r)
        state = state.to(buf.dtype)
        _index_put(buf, [s, r], state if keep is None else torch.where(keep[:, :, None, None], state, buf[s, r]))
