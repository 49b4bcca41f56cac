"""The generic MoE decoder: embed → [norm → attention → norm → MoE or MLP] × L → norm → lm_head.

Per-family differences are config fields (q/k norm, qkv bias, clip_qkv, shared expert,
dense layers, partial rotary, attention sinks, per-layer sliding windows; Llama-4's NoPE layers with their
attention temperature, chunked local attention and L2 q/k norm); multi-head latent
attention is `mla.py`, RoPE `rope.py`, the MoE block and router `moe.py` and `routers.py`. Modules are
built on the `meta` device and weights assigned by the loader. Expert weights are not
module parameters: the MoE block gets them from an `ExpertProvider` by (layer, expert).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specmoe import kernels as native
from specmoe.config import ModelConfig
from specmoe.models.attention import attention, fixed_split, read_keys
from specmoe.models.deltanet import GatedDeltaNet
from specmoe.models.kv_cache import KVCache, round_positions
from specmoe.models.rowclasses import deterministic_rows
from specmoe.models.layers import DenseMLP, Embedding, RMSNorm, addmm, linear, set_min_rows, sigmoid
from specmoe.models.mla import MLAttention
from specmoe.models.moe import ForwardContext, MoEBlock
from specmoe.models.rope import apply_rope, deinterleave, inv_freq, rope_tables

# B=batch, T=tokens per sequence, S=key positions, D=hidden, Hq/Hkv=heads, Dh=head dim, V=vocab


@dataclass
class BatchView:
    """Which cache slots a forward touches and where its tokens sit.

    slots: [B] cache rows (None when `contiguous` says which); positions: [B, T] absolute positions; valid:
    [B, T] mask of real (non-padding) tokens or None; contiguous: slice of slots when they are a range
    (lets attention read the cache without a gather)."""
    slots: torch.Tensor | None
    positions: torch.Tensor
    valid: torch.Tensor | None = None
    contiguous: slice | None = None
    key_len: int = 0  # S: positions attended over (max position + 1)
    # where the tokens' K/V go (set once per forward): (slot [B·T], position [B·T]), or flat rows [B·T] (see
    # `KVCache.write`)
    write_index: tuple[torch.Tensor, torch.Tensor] | torch.Tensor | None = None
    real_tokens: int | None = None  # tokens that are not padding (host int; needed with `valid`)
    # one new token per row and every row's at position key_len - 1: every key is visible (no mask needed)
    last_only: bool = False
    flat_positions: torch.Tensor | None = None  # [B·T] `positions` flattened (set by whoever builds the view)
    # token trees (speculative verification of a draft tree): `positions` are the RoPE positions (start +
    # depth), the tokens write K/V at `write_positions` [B, T] (start + t, scratch past the committed length)
    # and query t sees the committed prefix plus the new tokens u with tree[b, t, u] (its ancestors + itself)
    tree: torch.Tensor | None = None  # [B, T, T] bool
    write_positions: torch.Tensor | None = None  # [B, T]


def tree_attention_mask(bv: BatchView, window: int | None, chunk: int | None = None) -> torch.Tensor:
    """[B, 1, T, S] bool for a tree verification (`BatchView.tree`): key j is visible to query t iff j is in
    the committed prefix (j < start) or j = start + u with tree[b, t, u]; with a window, iff the key's RoPE
    position (j itself in the prefix, positions[b, u] in the tree) is inside the query's window; with a chunk,
    iff that position is in the query's chunk."""
    B, T = bv.positions.shape
    dev = bv.positions.device
    keys = torch.arange(bv.key_len, device=dev)
    rel = keys[None, :] - bv.write_positions[:, :1]  # [B, S]: the key's node index (in [0, T) for the tree)
    in_tree = (rel >= 0) & (rel < T)
    node = rel.clamp(0, T - 1)
    mask = (rel < 0)[:, None, :] | (in_tree[:, None, :] & torch.gather(bv.tree, 2, node[:, None, :].expand(B, T, -1)))
    if window or chunk:
        key_pos = torch.where(in_tree, torch.gather(bv.positions, 1, node), keys[None, :])  # [B, S]
        if window:
            mask &= key_pos[:, None, :] > bv.positions[:, :, None] - window
        if chunk:
            mask &= (key_pos // chunk)[:, None, :] == (bv.positions // chunk)[:, :, None]
        mask = see_all_if_padding(mask, bv)
    return mask[:, None]


def see_all_if_padding(mask: torch.Tensor, bv: BatchView) -> torch.Tensor:
    """mask [B, T, S] with padding queries (`bv.valid` False) seeing every key. Under a window or a chunk a padding
    query past its row's keys may see none, and an empty softmax is 0/0: NaN in its row (dropped, but written into
    the KV cache, where a later forward's p·V multiplies it by an exact 0 and still gets NaN)."""
    return mask if bv.valid is None else mask | ~bv.valid[:, :, None]


def temperature(positions: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """Llama-4's attention temperature of NoPE layers at positions [N]: log1p(floor((p + 1) / floor_scale)) ·
    attn_scale + 1 → [N, 1, 1, 1] fp32 (each query is scaled by its own)."""
    p = positions.float()
    return (torch.log1p(torch.floor((p + 1.0) / cfg.attn_floor_scale)) * cfg.attn_scale + 1.0).view(-1, 1, 1, 1)


def attention_mask(bv: BatchView, window: int | None, chunk: int | None = None) -> torch.Tensor | None:
    """[B, 1, T, S] bool over S = padded_keys(key_len): key j visible to the query at position p iff j <= p
    (and inside the window, and in p's chunk: j // chunk == p // chunk); None when every key below key_len is
    visible (one query per row, every row at the last of the key_len positions)."""
    if bv.tree is not None:
        return tree_attention_mask(bv, window, chunk)
    if bv.last_only and (not window or window >= bv.key_len) and (not chunk or chunk >= bv.key_len):
        return None
    keys = torch.arange(bv.key_len, device=bv.positions.device)
    mask = keys[None, None, :] <= bv.positions[:, :, None]  # [B, T, S]
    if window:
        mask &= keys[None, None, :] > bv.positions[:, :, None] - window
    if chunk:
        mask &= (keys // chunk)[None, None, :] == (bv.positions // chunk)[:, :, None]
    if window or chunk:
        mask = see_all_if_padding(mask, bv)
    return mask[:, None]


def set_write_index(bv: BatchView, cache: KVCache, device: torch.device) -> None:
    """Where the forward's tokens write their K/V, when whoever built the view did not say (`BatchView.write_index`)."""
    if bv.write_index is None:
        slots = bv.slots if bv.slots is not None else torch.arange(bv.contiguous.start, bv.contiguous.stop,
                                                                   device=device)
        bv.write_index = cache.write_index(slots, bv.positions if bv.write_positions is None else bv.write_positions)


class Attention(nn.Module):
    rows = 1  # see `layers.linear`; set on a deterministic model (`Transformer.set_deterministic`)

    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        D, Hq, Hkv, Dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.cfg = cfg
        self.rotary = cfg.rotary(layer)  # False: a NoPE layer (Llama-4)
        self.temperature = not self.rotary and cfg.attn_floor_scale is not None
        self.q_proj = nn.Linear(D, Hq * Dh * (2 if cfg.attn_output_gate else 1), bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(D, Hkv * Dh, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(D, Hkv * Dh, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(Hq * Dh, D, bias=cfg.o_proj_bias)
        if cfg.attention_sinks:
            self.sinks = nn.Parameter(torch.empty(Hq))
        self.qkv_weight = self.qkv_bias = self.qk_norm_weight = self.o_weight_t = None  # set by `fuse`
        if cfg.qk_norm == "head":
            self.q_norm, self.k_norm = RMSNorm(Dh, cfg.rms_norm_eps), RMSNorm(Dh, cfg.rms_norm_eps)
        elif cfg.qk_norm == "full":
            self.q_norm, self.k_norm = RMSNorm(Hq * Dh, cfg.rms_norm_eps), RMSNorm(Hkv * Dh, cfg.rms_norm_eps)

    def fuse(self) -> None:
        """After loading: one [(Hq + 2·Hkv)·Dh, D] projection for q, k and v (the loaded q/k/v weights become
        views of it, so nothing is held twice and the checkpoint's names stay), and the per-head q/k norm
        weights as one table."""
        cfg, projs = self.cfg, (self.q_proj, self.k_proj, self.v_proj)
        self.qkv_weight = torch.cat([p.weight for p in projs])
        self.qkv_bias = torch.cat([p.bias for p in projs]) if cfg.qkv_bias else None
        start = 0
        for p in projs:
            n = p.weight.shape[0]
            p.weight = nn.Parameter(self.qkv_weight[start:start + n], requires_grad=False)
            if cfg.qkv_bias:
                p.bias = nn.Parameter(self.qkv_bias[start:start + n], requires_grad=False)
            start += n
        if cfg.qk_norm == "head":
            self.qk_norm_weight = self._qk_norm_table()  # [Hq + Hkv, 1, Dh]
        self.o_weight_t = None if cfg.o_proj_bias else self.o_proj.weight.t()  # residual + out @ Wᵀ in one addmm

    def keep_stored(self, dtype: torch.dtype) -> None:
        """After `fuse`: hold the q/k/v and output projections in `dtype` (the checkpoint's; `linear` / `addmm` then
        compute natively from it), the q/k/v weights again views of the fused one."""
        self.qkv_weight = self.qkv_weight.to(dtype)
        start = 0
        for p in (self.q_proj, self.k_proj, self.v_proj):
            n = p.weight.shape[0]
            p.weight = nn.Parameter(self.qkv_weight[start:start + n], requires_grad=False)
            start += n
        self.o_proj.weight = nn.Parameter(self.o_proj.weight.to(dtype), requires_grad=False)
        self.o_weight_t = None if self.o_weight_t is None else self.o_proj.weight.t()

    def _fused(self):
        """(q/k/v weight, bias, per-head q/k norm weight): made once by `fuse` after loading; a module used
        without it (a head being trained) concatenates its projections per call."""
        if self.qkv_weight is not None:
            return self.qkv_weight, self.qkv_bias, self.qk_norm_weight
        cfg, projs = self.cfg, (self.q_proj, self.k_proj, self.v_proj)
        w = torch.cat([p.weight for p in projs])
        b = torch.cat([p.bias for p in projs]) if cfg.qkv_bias else None
        return w, b, self._qk_norm_table() if cfg.qk_norm == "head" else None

    def _qk_norm_table(self) -> torch.Tensor:
        """The per-head q/k norm weights as one [Hq + Hkv, 1, Dh] table (zero-centred norms: 1 + w in fp32)."""
        cfg = self.cfg
        t = torch.cat((self.q_norm.weight.expand(cfg.num_heads, -1), self.k_norm.weight.expand(cfg.num_kv_heads, -1)))
        return (1.0 + t.float() if cfg.norm_offset else t)[:, None]

    def _qkv(self, x):
        """x [N, D] → q and k as one [N, Hq + Hkv, 1, Dh] tensor (normed as the family does, not yet rotated),
        v [N, Hkv, 1, Dh] (the 1: at one token per row, q is already SDPA's [B, Hq, T, Dh]), and the output gate
        [N, Hq·Dh] (None without `attn_output_gate`)."""
        cfg = self.cfg
        Hq, Hkv, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        w_qkv, b_qkv, w_norm = self._fused()
        qkv = linear(x, w_qkv, b_qkv, self.rows)  # [N, (Hq + 2·Hkv)·Dh] (gated: [N, (2·Hq + 2·Hkv)·Dh])
        gate = None
        if cfg.attn_output_gate:  # q_proj's rows are [query; gate] per head
            qg, kv = qkv.split((2 * Hq * Dh, 2 * Hkv * Dh), dim=-1)
            qg = qg.view(-1, Hq, 2, Dh)
            gate = qg[:, :, 1].reshape(-1, Hq * Dh)
            qkv = torch.cat((qg[:, :, 0].reshape(-1, Hq * Dh), kv), dim=-1)
        if cfg.qk_norm == "full":  # OLMoE: norm over the whole projection, before the head split
            q, k, v = qkv.split((Hq * Dh, Hkv * Dh, Hkv * Dh), dim=-1)
            qkv = torch.cat((self.q_norm(q), self.k_norm(k), v), dim=-1)
        if cfg.clip_qkv is not None:
            qkv = qkv.clamp(-cfg.clip_qkv, cfg.clip_qkv)
        qk, v = qkv.view(x.shape[0], Hq + 2 * Hkv, 1, Dh).split((Hq + Hkv, Hkv), dim=1)
        if cfg.qk_norm == "head" and qk.dtype == torch.float32 and qk.device.type == "cpu" and native.available():
            qk = native.rms_norm(qk, w_norm, cfg.rms_norm_eps)  # the per-head weights in the same op
        elif cfg.qk_norm == "head" and cfg.norm_offset:  # zero-centred (Qwen3-Next): scale in fp32, then round
            qk = (F.rms_norm(qk.float(), (Dh,), None, cfg.rms_norm_eps) * w_norm).to(qk.dtype)
        elif cfg.qk_norm == "head":  # Qwen3: per-head norm (transformers: normalise in fp32, round, scale)
            qk = (F.rms_norm(qk, (Dh,), None, cfg.rms_norm_eps) * w_norm if qk.dtype == torch.float32
                  else w_norm * F.rms_norm(qk.float(), (Dh,), None, cfg.rms_norm_eps).to(qk.dtype))
        return qk, v, gate

    def forward(self, x, cos, sin, mask, cache: KVCache, layer: int, bv: BatchView,
                residual: torch.Tensor | None = None):
        """x [B·T, D] (tokens flattened) → residual + attention(x) [B·T, D] (no residual: attention(x)); cos/sin
        [B·T, 1, 1, R] (see `Transformer.rope`)."""
        cfg = self.cfg
        B, T = bv.positions.shape
        qk, v, gate = self._qkv(x)
        if self.rotary:
            qk = apply_rope(deinterleave(qk) if cfg.rope_interleave else qk, cos, sin)
            if cfg.qk_norm == "l2":  # Llama-4: weightless RMS norm of each rotated head (fp32, rounded)
                qk = F.rms_norm(qk.float(), (cfg.head_dim,), None, cfg.rms_norm_eps).to(qk.dtype)
        q, k = qk.split((cfg.num_heads, cfg.num_kv_heads), dim=1)  # [B·T, H, 1, Dh]
        if self.temperature:
            pos = bv.flat_positions if bv.flat_positions is not None else bv.positions.reshape(-1)
            q = (q * temperature(pos, cfg)).to(q.dtype)
        cache.write(layer, bv.write_index, k, v)
        fixed = fixed_split(q, self.rows) or cfg.attention_sinks
        keys, values = read_keys(cache, layer, bv, fixed)  # [B, Hkv, S, Dh], S: key_len (rounded up to a block)
        if T > 1:
            q = q.view(B, T, cfg.num_heads, cfg.head_dim).transpose(1, 2)  # [B, Hq, T, Dh]
        out = attention(q, keys, values, mask, cfg.head_dim ** -0.5, bv.key_len,
                        self.sinks if cfg.attention_sinks else None, invariant=fixed)  # [B, Hq, T, Dh]
        out = out.view(B, -1) if T == 1 else out.transpose(1, 2).reshape(B * T, -1)  # [B·T, Hq·Dh]
        if gate is not None:
            out = out * sigmoid(gate)
        if residual is None or self.o_weight_t is None:
            o = linear(out, self.o_proj.weight, self.o_proj.bias, self.rows)
            return o if residual is None else residual + o
        return addmm(residual, out, self.o_weight_t, self.rows)  # [B·T, D]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.linear = layer in cfg.linear_layers  # Gated DeltaNet instead of attention (hybrid models)
        self.cache_index = cfg.cache_index(layer)  # its row in the KV cache, or in the cache's linear states
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.attn = (GatedDeltaNet(cfg) if self.linear else MLAttention(cfg) if cfg.mla is not None
                     else Attention(cfg, layer))
        self.mask_kind = (cfg.window(layer), cfg.chunk(layer))  # (sliding window, attention chunk)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        self.is_moe = cfg.is_moe_layer(layer)
        self.mlp = MoEBlock(cfg, layer) if self.is_moe else DenseMLP(cfg.hidden_size, cfg.dense_intermediate_size)

    def forward(self, x, cos, sin, masks, cache, bv, ctx: ForwardContext):
        x = self.attn(self.input_norm(x), cos, sin, masks[self.mask_kind], cache, self.cache_index, bv, residual=x)
        h = self.post_attn_norm(x)
        return x + (self.mlp(h, ctx) if self.is_moe else self.mlp(h))


class Transformer(nn.Module):
    rows = 1  # see `set_deterministic`

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # a tied LM head in the checkpoint's stored dtype, beside the compute-dtype embedding table the lookups read
        # (`keep_stored`): the head's product then runs on the native kernels at half an fp32 copy's bytes
        self.register_parameter("head_stored", None)
        self._inv_freq: torch.Tensor | None = None
        self._rope_tables: tuple | None = None  # (positions, device, dtype, cos, sin [P, 1, 1, R])
        self._mask_kinds = {layer.mask_kind for layer in self.layers}

    def fuse(self) -> "Transformer":
        """After the weights are assigned: fused q/k/v projections (see `Attention.fuse`), linear attention's
        one input projection (`GatedDeltaNet.fuse`), zero-centred norms' fp32 scales (`RMSNorm.fuse`)."""
        for layer in self.layers:
            if isinstance(layer.attn, (Attention, GatedDeltaNet)):
                layer.attn.fuse()
        for m in self.modules():
            if isinstance(m, RMSNorm):
                m.fuse()
        return self

    def keep_stored(self, dtype: torch.dtype) -> "Transformer":
        """After `fuse`: the attention (q/k/v, output), dense-MLP and shared-expert projections and the LM head (untied;
        tied: a stored-dtype copy of the table for the head alone) held in `dtype`, the checkpoint's own (bf16 / fp16), while activations, norms, routers and the embedding stay
        in the compute dtype: `layers.linear` computes such a weight on the native kernels, reading half the bytes of
        an fp32 copy. The loader calls it where those kernels run (`models.loader.stored_dtype`)."""
        for layer in self.layers:
            if isinstance(layer.attn, Attention):
                layer.attn.keep_stored(dtype)
        for m in self.modules():
            if isinstance(m, DenseMLP):
                m.keep_stored(dtype)
        if not self.cfg.tie_word_embeddings:
            self.lm_head.weight = nn.Parameter(self.lm_head.weight.to(dtype), requires_grad=False)
        else:  # tied: the head reads a stored-dtype table (the lookups keep the compute-dtype one)
            self.head_stored = nn.Parameter(self.embed.weight.detach().to(dtype), requires_grad=False)
        return self

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype activations and the KV cache are in (the embedding's; projections may be held in another)."""
        return self.embed.weight.dtype

    def set_deterministic(self, on: bool) -> "Transformer":
        """`deterministic`: fp32 GEMMs (and routed-expert groups) of fewer than `rowclasses.deterministic_rows()` rows
        (measured on this machine) are padded to that many and fp32 attention takes the fixed split (`attention.attend`), so a row's result does not
        depend on how many rows share its forward. bf16 / fp16 need nothing: their CPU GEMMs round a row the same at
        every row count, and their attention always takes the fixed split."""
        set_min_rows(self, deterministic_rows() if on else 1)
        return self

    def head_weight(self) -> torch.Tensor:
        if not self.cfg.tie_word_embeddings:
            return self.lm_head.weight
        return self.head_stored if self.head_stored is not None else self.embed.weight

    def rope(self, bv: BatchView, dtype: torch.dtype):
        """cos and signed sin ([-sin, sin] over the two halves, see `rope.apply_rope`) at the forward's positions
        as [B·T, 1, 1, R] (R: the rotating dims of a head): rows of per-position tables computed once (fp32 math,
        cast like transformers) and grown in blocks as positions grow."""
        positions = bv.flat_positions if bv.flat_positions is not None else bv.positions.reshape(-1)  # [B·T]
        need, device = max(bv.key_len, 1), positions.device
        tab = self._rope_tables
        if tab is None or tab[0] < need or tab[1] != device or tab[2] != dtype:
            if self._inv_freq is None or self._inv_freq.device != device:
                self._inv_freq, self._rope_scaling = inv_freq(self.cfg, device)
            n = max(round_positions(need), tab[0] if tab is not None and tab[1] == device else 0)
            cos, sin = rope_tables(torch.arange(n, device=device)[None], self._inv_freq, self._rope_scaling, dtype)
            tab = self._rope_tables = (n, device, dtype, cos[0, :, None], sin[0, :, None])  # [P, 1, 1, R] each
        return tab[3][positions], tab[4][positions]

    def forward(self, tokens: torch.Tensor, cache: KVCache, bv: BatchView, ctx: ForwardContext,
                logits_at: torch.Tensor | None = None, flat: bool = False) -> torch.Tensor:
        """tokens [B, T] → logits [B, T, V] (or [B, n, V] at the index tensor `logits_at` [B, n]; with `flat`,
        [B·T, V]). The hidden states are [B·T, D] between the layers (no reshape per layer)."""
        B, T = tokens.shape
        x = self.embed(tokens.view(-1))  # [B·T, D]
        set_write_index(bv, cache, tokens.device)
        cos, sin = self.rope(bv, x.dtype)
        masks = {kind: attention_mask(bv, *kind) for kind in self._mask_kinds}
        ctx.padding = None if bv.valid is None else ~bv.valid.reshape(-1, 1)  # [B·T, 1]
        ctx.real_tokens = None if bv.valid is None else bv.real_tokens
        for i, layer in enumerate(self.layers):
            if i in ctx.capture_hidden:
                ctx.hidden[i] = x.view(B, T, -1)
            x = layer(x, cos, sin, masks, cache, bv, ctx)
        if flat:
            x = self.norm(x)
            if len(self.layers) in ctx.capture_hidden:
                ctx.hidden[len(self.layers)] = x.view(B, T, -1)
            return linear(x, self.head_weight(), None, self.rows)
        x = x.view(B, T, -1)
        if len(self.layers) in ctx.capture_hidden:
            ctx.hidden[len(self.layers)] = self.norm(x)
        if logits_at is not None:
            x = torch.gather(x, 1, logits_at[..., None].expand(-1, -1, x.shape[-1]))
        x = self.norm(x)
        return linear(x, self.head_weight(), None, self.rows)
