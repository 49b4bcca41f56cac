"""The generic MoE decoder: embed → [norm → attention → norm → MoE or MLP] × L → norm → lm_head.

Per-family differences are config fields (q/k norm, qkv bias, clip_qkv, shared expert,
dense layers, partial rotary, attention sinks, per-layer sliding windows); multi-head latent
attention is `mla.py`, RoPE `rope.py`, the MoE block and router `moe.py` and `routers.py`. Modules are
built on the `meta` device and weights assigned by the loader. Expert weights are not
module parameters: the MoE block gets them from an `ExpertProvider` by (layer, expert).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specmoe.config import ModelConfig
from specmoe.models.attention import sink_attention
from specmoe.models.kv_cache import KVCache
from specmoe.models.layers import DenseMLP, Embedding, RMSNorm
from specmoe.models.mla import MLAttention
from specmoe.models.moe import ForwardContext, MoEBlock
from specmoe.models.rope import apply_rope, inv_freq, rope_tables

# B=batch, T=tokens per sequence, S=key positions, D=hidden, Hq/Hkv=heads, Dh=head dim, V=vocab


@dataclass
class BatchView:
    """Which cache slots a forward touches and where its tokens sit.

    slots: [B] cache rows; positions: [B, T] absolute positions; valid: [B, T] mask of
    real (non-padding) tokens or None; contiguous: slice of slots when they are a range
    (lets attention read the cache without a gather)."""
    slots: torch.Tensor
    positions: torch.Tensor
    valid: torch.Tensor | None = None
    contiguous: slice | None = None
    key_len: int = 0  # S: positions attended over (max position + 1)
    write_index: torch.Tensor | None = None  # [B·T] KV rows the tokens write (set once per forward)
    real_tokens: int | None = None  # tokens that are not padding (host int; needed with `valid`)
    # token trees (speculative verification of a draft tree): `positions` are the RoPE positions (start +
    # depth), the tokens write K/V at `write_positions` [B, T] (start + t, scratch past the committed length)
    # and query t sees the committed prefix plus the new tokens u with tree[b, t, u] (its ancestors + itself)
    tree: torch.Tensor | None = None  # [B, T, T] bool
    write_positions: torch.Tensor | None = None  # [B, T]


def tree_attention_mask(bv: BatchView, window: int | None) -> torch.Tensor:
    """[B, 1, T, S] bool for a tree verification (`BatchView.tree`): key j is visible to query t iff j is in
    the committed prefix (j < start) or j = start + u with tree[b, t, u]; with a window, iff the key's RoPE
    position (j itself in the prefix, positions[b, u] in the tree) is inside the query's window."""
    B, T = bv.positions.shape
    dev = bv.positions.device
    keys = torch.arange(bv.key_len, device=dev)
    rel = keys[None, :] - bv.write_positions[:, :1]  # [B, S]: the key's node index (in [0, T) for the tree)
    in_tree = (rel >= 0) & (rel < T)
    node = rel.clamp(0, T - 1)
    mask = (rel < 0)[:, None, :] | (in_tree[:, None, :] & torch.gather(bv.tree, 2, node[:, None, :].expand(B, T, -1)))
    if window:
        key_pos = torch.where(in_tree, torch.gather(bv.positions, 1, node), keys[None, :])  # [B, S]
        mask &= key_pos[:, None, :] > bv.positions[:, :, None] - window
    return mask[:, None]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        D, Hq, Hkv, Dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.cfg = cfg
        self.q_proj = nn.Linear(D, Hq * Dh, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(D, Hkv * Dh, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(D, Hkv * Dh, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(Hq * Dh, D, bias=cfg.o_proj_bias)
        if cfg.attention_sinks:
            self.sinks = nn.Parameter(torch.empty(Hq))
        if cfg.qk_norm == "head":
            self.q_norm, self.k_norm = RMSNorm(Dh, cfg.rms_norm_eps), RMSNorm(Dh, cfg.rms_norm_eps)
        elif cfg.qk_norm == "full":
            self.q_norm, self.k_norm = RMSNorm(Hq * Dh, cfg.rms_norm_eps), RMSNorm(Hkv * Dh, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, mask, cache: KVCache, layer: int, bv: BatchView):
        """x [B·T, D] (tokens flattened) → [B·T, D]."""
        cfg = self.cfg
        B, T = bv.positions.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)  # [B·T, H·Dh]
        if cfg.qk_norm == "full":  # OLMoE: norm over the whole projection, before the head split
            q, k = self.q_norm(q), self.k_norm(k)
        if cfg.clip_qkv is not None:
            q, k, v = (t.clamp(-cfg.clip_qkv, cfg.clip_qkv) for t in (q, k, v))
        q = q.view(B, T, cfg.num_heads, cfg.head_dim)  # [B, T, Hq, Dh]
        k = k.view(B, T, cfg.num_kv_heads, cfg.head_dim)  # [B, T, Hkv, Dh]
        v = v.view(B, T, cfg.num_kv_heads, cfg.head_dim)
        if cfg.qk_norm == "head":  # Qwen3: per-head norm
            q, k = self.q_norm(q), self.k_norm(k)
        q = apply_rope(q, cos, sin)  # cos/sin: [B, T, 1, R], sin signed as in `Transformer.rope`
        k = apply_rope(k, cos, sin)
        cache.write(layer, bv.write_index, k, v)
        keys, values = cache.read(layer, bv.slots, bv.contiguous, bv.key_len)  # [B, S, Hkv, Dh]
        if cfg.attention_sinks:
            out = sink_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), mask, self.sinks,
                                 cfg.head_dim ** -0.5)
        else:
            out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                                 attn_mask=mask, enable_gqa=cfg.num_heads != cfg.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(B * T, -1))  # [B·T, D]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = MLAttention(cfg) if cfg.mla is not None else Attention(cfg)
        self.window = cfg.window(layer)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.is_moe = cfg.is_moe_layer(layer)
        self.mlp = MoEBlock(cfg, layer) if self.is_moe else DenseMLP(cfg.hidden_size, cfg.dense_intermediate_size)

    def forward(self, x, cos, sin, masks, cache, bv, ctx: ForwardContext):
        x = x + self.attn(self.input_norm(x), cos, sin, masks[self.window], cache, self.layer, bv)
        h = self.post_attn_norm(x)
        return x + (self.mlp(h, ctx) if self.is_moe else self.mlp(h))


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self._inv_freq: torch.Tensor | None = None

    def head_weight(self) -> torch.Tensor:
        return self.embed.weight if self.cfg.tie_word_embeddings else self.lm_head.weight

    def rope(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos and signed sin ([-sin, sin] over the two halves, see `rope.apply_rope`) for [B, T] positions as
        [B, T, 1, R] (R: the rotating dims of a head)."""
        if self._inv_freq is None or self._inv_freq.device != positions.device:
            self._inv_freq, self._rope_scaling = inv_freq(self.cfg, positions.device)
        return rope_tables(positions, self._inv_freq, self._rope_scaling, dtype)

    def attention_mask(self, bv: BatchView, window: int | None) -> torch.Tensor:
        """[B, 1, T, S] bool: key j visible to the query at position p iff j <= p (and inside the window)."""
        if bv.tree is not None:
            return tree_attention_mask(bv, window)
        keys = torch.arange(bv.key_len, device=bv.positions.device)
        mask = keys[None, None, :] <= bv.positions[:, :, None]  # [B, T, S]
        if window:
            mask &= keys[None, None, :] > bv.positions[:, :, None] - window
        return mask[:, None]

    def forward(self, tokens: torch.Tensor, cache: KVCache, bv: BatchView, ctx: ForwardContext,
                logits_at: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, T] → logits [B, T, V] (or [B, n, V] at the index tensor `logits_at` [B, n]). The hidden
        states are [B·T, D] between the layers (no reshape per layer)."""
        B, T = tokens.shape
        x = self.embed(tokens.reshape(-1))  # [B·T, D]
        cos, sin = self.rope(bv.positions, x.dtype)
        masks = {w: self.attention_mask(bv, w) for w in {layer.window for layer in self.layers}}
        bv.write_index = cache.write_index(bv.slots, bv.positions if bv.write_positions is None else bv.write_positions)
        ctx.padding = None if bv.valid is None else ~bv.valid.reshape(-1, 1)  # [B·T, 1]
        ctx.real_tokens = None if bv.valid is None else bv.real_tokens
        for i, layer in enumerate(self.layers):
            if i in ctx.capture_hidden:
                ctx.hidden[i] = x.view(B, T, -1)
            x = layer(x, cos, sin, masks, cache, bv, ctx)
        x = x.view(B, T, -1)
        if len(self.layers) in ctx.capture_hidden:
            ctx.hidden[len(self.layers)] = self.norm(x)
        if logits_at is not None:
            x = torch.gather(x, 1, logits_at[..., None].expand(-1, -1, x.shape[-1]))
        x = self.norm(x)
        return F.linear(x, self.head_weight())
