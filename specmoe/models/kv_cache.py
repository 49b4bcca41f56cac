"""KV cache addressed by (slot, position), sized by what the admitted requests use.

Each sequence of a batch owns a slot (a row of the cache) and a length. A forward
writes keys/values at explicit positions, so rolling back rejected draft tokens is
just setting the length back (gpt-fast style); stale entries past a sequence's length
are masked by causality and overwritten by the next write.

The cache holds `max_batch` slots × `max_seq` positions, both set by the engine from the
requests it admits; `reserve` grows either (positions in blocks of `BLOCK`), keeping the
contents, so a sequence is read as one contiguous [S, Hkv, Dh] row whatever its history.
"""
from __future__ import annotations

import torch

from specmoe.errors import MemoryBudgetError
from specmoe.experts.memory import check_fits, fmt_bytes

# L=layers, Bmax=slots, S=positions, Hkv=kv heads, Dh=head dim

BLOCK = 256  # positions are allocated in multiples of this (growth copies the cache once per block)


def round_positions(n: int, cap: int | None = None) -> int:
    """n rounded up to a whole block, never beyond `cap` (the most positions a run can write)."""
    n = -(-n // BLOCK) * BLOCK
    return n if cap is None else max(1, min(n, cap))


def kv_bytes(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, slots: int,
             positions: int, v_head_dim: int | None = None) -> int:
    """Bytes of keys + values of `slots` × `positions` over all layers (values of `v_head_dim` dims, default
    head_dim; 0: keys only, as MLA's latent cache)."""
    dims = head_dim + (head_dim if v_head_dim is None else v_head_dim)
    return num_layers * slots * positions * num_kv_heads * dims * torch.finfo(dtype).bits // 8


class KVCache:
    def __init__(self, *, num_layers: int, max_batch: int, max_seq: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu", v_head_dim: int | None = None):
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.v_head_dim = head_dim if v_head_dim is None else v_head_dim  # 0: keys only (MLA's latent cache)
        self.dtype, self.device = dtype, torch.device(device)
        self.max_batch = self.max_seq = 0
        self.k = self.v = None
        self.lengths: list[int] = []  # committed tokens per slot (host side, the scheduler's truth)
        self.reserve(max_batch, max_seq)

    def bytes_for(self, slots: int, positions: int) -> int:
        """Bytes of keys + values for `slots` × `positions`."""
        return kv_bytes(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype, slots, positions,
                        self.v_head_dim)

    @property
    def nbytes(self) -> int:
        return self.bytes_for(self.max_batch, self.max_seq)

    def reserve(self, slots: int, positions: int) -> None:
        """Hold at least `slots` × `positions`, growing (and copying the contents) when smaller."""
        slots, positions = max(slots, self.max_batch), max(positions, self.max_seq)
        if slots == self.max_batch and positions == self.max_seq:
            return
        need = self.bytes_for(slots, positions)
        what = f"the KV cache ({slots} slot(s) × {positions} positions × {self.num_layers} layers, {fmt_bytes(need)})"
        check_fits(what, need, self.device)
        try:
            shape = (self.num_layers, slots, positions, self.num_kv_heads, self.head_dim)
            k = torch.zeros(shape, dtype=self.dtype, device=self.device)  # [L, Bmax, S, Hkv, Dh]
            v = torch.zeros(shape[:-1] + (self.v_head_dim,), dtype=self.dtype, device=self.device) \
                if self.v_head_dim else None
        except (RuntimeError, MemoryError) as e:
            raise MemoryBudgetError(f"{what} does not fit: {e}") from None
        if self.k is not None:  # growth keeps every slot's keys/values
            k[:, : self.max_batch, : self.max_seq] = self.k
            if v is not None:
                v[:, : self.max_batch, : self.max_seq] = self.v
        self.k, self.v = k, v
        self.lengths += [0] * (slots - self.max_batch)
        self.max_batch, self.max_seq = slots, positions

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              valid: torch.Tensor | None) -> None:
        """k, v: [B, T, Hkv, Dh] written at (slots[b], positions[b, t]) where valid[b, t] (v None: keys only)."""
        B, T = positions.shape
        rows = slots[:, None].expand(B, T)
        if valid is not None:
            rows, positions, k = rows[valid], positions[valid], k[valid]
            v = None if v is None else v[valid]
        self.k[layer].index_put_((rows.reshape(-1), positions.reshape(-1)), k.reshape(-1, *k.shape[-2:]))
        if v is not None:
            self.v[layer].index_put_((rows.reshape(-1), positions.reshape(-1)), v.reshape(-1, *v.shape[-2:]))

    def read(self, layer: int, slots: torch.Tensor, contiguous: slice | None, S: int):
        """Keys/values of the batch's slots over positions [0, S): [B, S, Hkv, Dh] each (values None when
        the cache holds keys only)."""
        if contiguous is not None:
            return self.k[layer, contiguous, :S], None if self.v is None else self.v[layer, contiguous, :S]
        return self.k[layer, slots, :S], None if self.v is None else self.v[layer, slots, :S]
