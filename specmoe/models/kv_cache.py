"""KV cache addressed by (slot, position), sized by what the admitted requests use.

Each sequence of a batch owns a slot (a row of the cache) and a length. A forward
writes keys/values at explicit positions, so rolling back rejected draft tokens is
just setting the length back (gpt-fast style); stale entries past a sequence's length
are masked by causality and overwritten by the next write.

The cache holds `max_batch` slots × `max_seq` positions, both set by the engine from the
requests it admits; `reserve` grows either (positions in blocks of `BLOCK`), keeping the
contents. The layout is head-major ([slot, head, position, dim] per layer), so a sequence's keys of one head
are one contiguous run and attention reads [B, Hkv, S, Dh] without a transpose.

A hybrid model's cache holds K/V for its attention layers only and, in `states`, the recurrent states of its
linear-attention layers (`linear_state.LinearStates`), slot for slot: the same lengths commit both.
"""
from __future__ import annotations

import torch

from specmoe.errors import MemoryBudgetError
from specmoe.memory import check_fits, fmt_bytes
from specmoe.models.linear_state import LinearStates, state_bytes

# L=layers, Bmax=slots, S=positions, Hkv=kv heads, Dh=head dim

_index_put = torch.ops.aten.index_put_  # t[slot, :, pos] = x as one op (indexing syntax adds a view)

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
                 dtype: torch.dtype, device: torch.device | str = "cpu", v_head_dim: int | None = None,
                 states: LinearStates | None = None):
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.v_head_dim = head_dim if v_head_dim is None else v_head_dim  # 0: keys only (MLA's latent cache)
        self.dtype, self.device = dtype, torch.device(device)
        self.max_batch = self.max_seq = 0
        self.k = self.v = None
        self.lengths: list[int] = []  # committed tokens per slot (host side, the scheduler's truth)
        self.states = states  # linear-attention layers' recurrent states (None: no such layers)
        self.reserve(max_batch, max_seq)

    def bytes_for(self, slots: int, positions: int) -> int:
        """Bytes of keys + values for `slots` × `positions`, plus the linear layers' states of `slots`."""
        return kv_bytes(self.num_layers, self.num_kv_heads, self.head_dim, self.dtype, slots, positions,
                        self.v_head_dim) + (self.states.bytes_for(slots) if self.states is not None else 0)

    @property
    def state_nbytes(self) -> int:
        """Bytes of the linear layers' states (constant in the sequences' lengths)."""
        return self.states.nbytes if self.states is not None else 0

    @property
    def nbytes(self) -> int:
        return self.bytes_for(self.max_batch, self.max_seq)

    def reserve(self, slots: int, positions: int) -> None:
        """Hold at least `slots` × `positions`, growing (and copying the contents) when smaller."""
        slots, positions = max(slots, self.max_batch), max(positions, self.max_seq)
        if self.states is not None:
            self.states.reserve(slots)
        if slots == self.max_batch and positions == self.max_seq:
            return
        need = self.bytes_for(slots, positions)
        what = f"the KV cache ({slots} slot(s) × {positions} positions × {self.num_layers} layers, {fmt_bytes(need)})"
        check_fits(what, need, self.device)
        try:
            num_kv, hd = self.num_kv_heads, self.head_dim
            shape = (self.num_layers, slots, num_kv, positions, hd)
            k = torch.zeros(shape, dtype=self.dtype, device=self.device)  # [L, Bmax, Hkv, S, Dh]
            v = torch.zeros(shape[:-1] + (self.v_head_dim,), dtype=self.dtype, device=self.device) \
                if self.v_head_dim else None
        except (RuntimeError, MemoryError) as e:
            raise MemoryBudgetError(f"{what} does not fit: {e}") from None
        if self.k is not None:  # growth keeps every slot's keys/values
            k[:, : self.max_batch, :, : self.max_seq] = self.k
            if v is not None:
                v[:, : self.max_batch, :, : self.max_seq] = self.v
        self.k, self.v = k, v
        # per-layer views made once: [Bmax, Hkv, S, Dh] to read, [Bmax, Hkv, S, 1, Dh] to write
        self.k_layer = list(k)
        self.v_layer = list(v) if v is not None else [None] * self.num_layers
        self.k_write = [t.unsqueeze(3) for t in self.k_layer]
        self.v_write = [None if t is None else t.unsqueeze(3) for t in self.v_layer]
        self.lengths += [0] * (slots - self.max_batch)
        self.max_batch, self.max_seq = slots, positions

    def write_index(self, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat row of each (slots[b], positions[b, t]), slot · max_seq + position: [B·T] (what `write` and
        `move` take; the runner hands `write` the (slot, position) pair directly, see `places`)."""
        return (slots[:, None] * self.max_seq + positions).reshape(-1)

    def places(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat rows (see `write_index`) → (slot, position)."""
        return torch.div(rows, self.max_seq, rounding_mode="floor"), rows % self.max_seq

    def write(self, layer: int, index, k: torch.Tensor, v: torch.Tensor | None) -> None:
        """k, v: [B·T, Hkv, 1, Dh] (the forward's tokens flattened; [B·T, Hkv, Dh] also taken) written at `index`:
        (slot [B·T], position [B·T]), or flat rows [B·T] (see `write_index`); v None: keys only. One indexed write
        each. Padding tokens of a ragged batch write too, at positions past their sequence's new tokens: scratch
        that causality masks and the next real write overwrites."""
        slot, pos = self.places(index) if isinstance(index, torch.Tensor) else index
        if k.dim() == 3:
            k, v = k[:, :, None], None if v is None else v[:, :, None]
        _index_put(self.k_write[layer], [slot, None, pos], k)
        if v is not None:
            _index_put(self.v_write[layer], [slot, None, pos], v)

    def read(self, layer: int, slots: torch.Tensor | None, contiguous: slice | None, S: int):
        """Keys/values of the batch's slots over positions [0, S): [B, Hkv, S, Dh] each (values None when
        the cache holds keys only); `contiguous`: the slots as a range (no gather; `slots` may then be None)."""
        k, v = self.k_layer[layer], self.v_layer[layer]
        if contiguous is not None:
            return k[contiguous, :, :S], None if v is None else v[contiguous, :, :S]
        return k[slots, :, :S], None if v is None else v[slots, :, :S]

    def move(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy the keys/values of flat rows `src` to flat rows `dst` (see `write_index`) in every layer: one
        gather + one indexed write per cache tensor (all layers at once). Used to compact an accepted tree path
        onto consecutive positions; the gather happens before the write, so src and dst may overlap."""
        (ss, ps), (sd, pd) = self.places(src), self.places(dst)
        for t in (self.k, self.v):
            if t is not None:  # [L, Bmax, Hkv, S, Dh]; t[:, slot, :, pos] is [N, L, Hkv, Dh]
                _index_put(t, [None, sd, None, pd], t[:, ss, :, ps])


class EncDecCache(KVCache):
    """An encoder–decoder model's cache: the decoder's self-attention K/V (this `KVCache`) and `cross`, a `KVCache`
    of the decoder's layers × the same slots × source positions holding each sequence's cross-attention K/V over its
    source, written once per request by the encoder (`cross.lengths[slot]`: its source length). Slots grow together;
    source positions grow (`reserve_source`) when a longer source arrives."""

    def __init__(self, *, source_positions: int = BLOCK, **kw):
        self.cross: KVCache | None = None
        self._source_positions = source_positions
        super().__init__(**kw)

    def reserve(self, slots: int, positions: int) -> None:
        super().reserve(slots, positions)
        if self.cross is None:
            self.cross = KVCache(num_layers=self.num_layers, max_batch=self.max_batch,
                                 max_seq=round_positions(self._source_positions), num_kv_heads=self.num_kv_heads,
                                 head_dim=self.head_dim, dtype=self.dtype, device=self.device)
        else:
            self.cross.reserve(self.max_batch, self.cross.max_seq)

    def reserve_source(self, positions: int) -> None:
        """Hold sources of at least `positions` tokens."""
        if positions > self.cross.max_seq:
            self.cross.reserve(self.max_batch, round_positions(positions))

    @property
    def cross_nbytes(self) -> int:
        return self.cross.nbytes


def model_cache_bytes(cfg, dtype: torch.dtype, slots: int, positions: int, ring: int = 2) -> int:
    """Bytes of `make_cache(cfg, ...)` for `slots` × `positions`: K/V of the attention layers, plus the
    linear-attention layers' states (`ring` rows per slot, see linear_state.py), plus an encoder–decoder model's
    cross-attention K/V over sources of up to max_position_embeddings tokens (`EncDecCache.cross`)."""
    heads, kdim, vdim = cfg.kv_cache_dims
    cross = 0 if cfg.seq2seq is None else kv_bytes(cfg.num_layers, heads, kdim, dtype, slots,
                                                   cfg.max_position_embeddings, vdim)
    return (kv_bytes(len(cfg.attention_layers), heads, kdim, dtype, slots, positions, vdim)
            + state_bytes(cfg, dtype, slots, ring) + cross)


def make_cache(cfg, *, max_batch: int, max_seq: int, dtype: torch.dtype, device: torch.device | str = "cpu",
               ring: int = 2, sources: bool = True) -> KVCache:
    """The cache a model of `cfg` runs with: K/V for its attention layers (`ModelConfig.attention_layers`) and,
    for a hybrid model, its linear layers' states with `ring` rows per slot (the strategy's lookahead + 1,
    `linear_state.for_lookahead`); an encoder–decoder model's is an `EncDecCache` (+ its sequences' cross-attention
    K/V), unless `sources` is False (a decoder-only forward, which such a model refuses: profiling)."""
    heads, kdim, vdim = cfg.kv_cache_dims
    states = (LinearStates(cfg, max_batch=max_batch, ring=ring, dtype=dtype, device=device)
              if cfg.linear_layers else None)
    kind = EncDecCache if cfg.seq2seq is not None and sources else KVCache
    return kind(num_layers=len(cfg.attention_layers), max_batch=max_batch, max_seq=max_seq, num_kv_heads=heads,
                head_dim=kdim, v_head_dim=vdim, dtype=dtype, device=device, states=states)
