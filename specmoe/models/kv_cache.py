"""Static KV cache addressed by (slot, position).

Each sequence of a batch owns a slot (a row of the cache) and a length. A forward
writes keys/values at explicit positions, so rolling back rejected draft tokens is
just setting the length back (gpt-fast style); stale entries past a sequence's length
are masked by causality and overwritten by the next write.
"""
from __future__ import annotations

import torch

from specmoe.errors import MemoryBudgetError

# L=layers, Bmax=slots, S=positions, Hkv=kv heads, Dh=head dim


class KVCache:
    def __init__(self, *, num_layers: int, max_batch: int, max_seq: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device | str = "cpu"):
        nbytes = 2 * num_layers * max_batch * max_seq * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8
        self.nbytes = nbytes
        try:
            shape = (num_layers, max_batch, max_seq, num_kv_heads, head_dim)
            self.k = torch.zeros(shape, dtype=dtype, device=device)  # [L, Bmax, S, Hkv, Dh]
            self.v = torch.zeros(shape, dtype=dtype, device=device)
        except (RuntimeError, MemoryError) as e:
            raise MemoryBudgetError(f"KV cache of {nbytes / 2**30:.2f} GiB ({max_batch} slots × {max_seq} "
                                    f"positions) does not fit: {e}") from None
        self.max_batch, self.max_seq = max_batch, max_seq
        self.lengths = [0] * max_batch  # committed tokens per slot (host side, the scheduler's truth)

    def write(self, layer: int, slots: torch.Tensor, positions: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
              valid: torch.Tensor | None) -> None:
        """k, v: [B, T, Hkv, Dh] written at (slots[b], positions[b, t]) where valid[b, t]."""
        B, T = positions.shape
        rows = slots[:, None].expand(B, T)
        if valid is not None:
            rows, positions, k, v = rows[valid], positions[valid], k[valid], v[valid]
        self.k[layer].index_put_((rows.reshape(-1), positions.reshape(-1)), k.reshape(-1, *k.shape[-2:]))
        self.v[layer].index_put_((rows.reshape(-1), positions.reshape(-1)), v.reshape(-1, *v.shape[-2:]))

    def read(self, layer: int, slots: torch.Tensor, contiguous: slice | None, S: int):
        """Keys/values of the batch's slots over positions [0, S): [B, S, Hkv, Dh] each."""
        if contiguous is not None:
            return self.k[layer, contiguous, :S], self.v[layer, contiguous, :S]
        return self.k[layer, slots, :S], self.v[layer, slots, :S]
