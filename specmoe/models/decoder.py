"""The generic MoE decoder: embed → [norm → attention → norm → MoE or MLP] × L → norm → lm_head.

Per-family differences are config fields (q/k norm, qkv bias, clip_qkv, shared expert,
dense layers); the MoE block and router live in `moe.py` and `routers.py`. Modules are
built on the `meta` device and weights assigned by the loader. Expert weights are not
module parameters: the MoE block gets them from an `ExpertProvider` by (layer, expert).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from specmoe.config import ModelConfig
from specmoe.models.kv_cache import KVCache
from specmoe.models.layers import DenseMLP, Embedding, RMSNorm
from specmoe.models.moe import ForwardContext, MoEBlock

# B=batch, T=tokens per sequence, S=key positions, D=hidden, Hq/Hkv=heads, Dh=head dim, V=vocab


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x·cos + rotate_half(x)·sin (HF's half-split layout) in three ops: rotate_half(x) = [-x2, x1] equals
    roll(x, Dh/2) = [x2, x1] times the signs [-1, +1], which `sin_signed` = [-sin, sin] carries."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, dims=-1), sin_signed)


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


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        D, Hq, Hkv, Dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.cfg = cfg
        self.q_proj = nn.Linear(D, Hq * Dh, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(D, Hkv * Dh, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(D, Hkv * Dh, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(Hq * Dh, D, bias=False)
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
        q = apply_rope(q, cos, sin)  # cos/sin: [B, T, 1, Dh], sin signed as in `Transformer.rope`
        k = apply_rope(k, cos, sin)
        cache.write(layer, bv.write_index, k, v)
        keys, values = cache.read(layer, bv.slots, bv.contiguous, bv.key_len)  # [B, S, Hkv, Dh]
        out = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                             attn_mask=mask, enable_gqa=cfg.num_heads != cfg.num_kv_heads)
        return self.o_proj(out.transpose(1, 2).reshape(B * T, -1))  # [B·T, D]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.input_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.post_attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.is_moe = cfg.is_moe_layer(layer)
        self.mlp = MoEBlock(cfg, layer) if self.is_moe else DenseMLP(cfg.hidden_size, cfg.dense_intermediate_size)

    def forward(self, x, cos, sin, mask, cache, bv, ctx: ForwardContext):
        x = x + self.attn(self.input_norm(x), cos, sin, mask, cache, self.layer, bv)
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
        """cos and signed sin ([-sin, sin] over the two halves, see `apply_rope`) for [B, T] positions as
        [B, T, 1, Dh] (fp32 math, cast like transformers)."""
        if self._inv_freq is None or self._inv_freq.device != positions.device:
            Dh = self.cfg.head_dim
            self._inv_freq = 1.0 / (self.cfg.rope_theta ** (
                torch.arange(0, Dh, 2, dtype=torch.int64, device=positions.device).float() / Dh))
        freqs = positions[..., None].float() * self._inv_freq  # [B, T, Dh/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]  # [B, T, 1, Dh]
        sin = freqs.sin()[:, :, None, :]
        return emb.cos().to(dtype), torch.cat((-sin, sin), dim=-1).to(dtype)

    def attention_mask(self, bv: BatchView) -> torch.Tensor:
        """[B, 1, T, S] bool: key j visible to the query at position p iff j <= p (and inside the window)."""
        keys = torch.arange(bv.key_len, device=bv.positions.device)
        mask = keys[None, None, :] <= bv.positions[:, :, None]  # [B, T, S]
        if self.cfg.sliding_window:
            mask &= keys[None, None, :] > bv.positions[:, :, None] - self.cfg.sliding_window
        return mask[:, None]

    def forward(self, tokens: torch.Tensor, cache: KVCache, bv: BatchView, ctx: ForwardContext,
                logits_at: torch.Tensor | None = None) -> torch.Tensor:
        """tokens [B, T] → logits [B, T, V] (or [B, n, V] at the index tensor `logits_at` [B, n]). The hidden
        states are [B·T, D] between the layers (no reshape per layer)."""
        B, T = tokens.shape
        x = self.embed(tokens.reshape(-1))  # [B·T, D]
        cos, sin = self.rope(bv.positions, x.dtype)
        mask = self.attention_mask(bv)
        bv.write_index = cache.write_index(bv.slots, bv.positions)
        ctx.padding = None if bv.valid is None else ~bv.valid.reshape(-1, 1)  # [B·T, 1]
        for layer in self.layers:
            x = layer(x, cos, sin, mask, cache, bv, ctx)
        x = x.view(B, T, -1)
        if logits_at is not None:
            x = torch.gather(x, 1, logits_at[..., None].expand(-1, -1, x.shape[-1]))
        x = self.norm(x)
        return F.linear(x, self.head_weight())
