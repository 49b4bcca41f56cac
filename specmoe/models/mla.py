"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) with a compressed KV cache.

Keys and values of all heads are linear in one per-token latent c (kv_lora_rank dims, after its RMSNorm)
plus one rotary key k_r shared by the heads (qk_rope_head_dim dims). The cache holds [c; k_r] per position,
one "head" of kv_lora_rank + qk_rope_head_dim values, never the expanded per-head K and V. Attention is
computed in the latent space ("absorbed"): with kv_b_proj = [W_uk; W_uv] per head,

    q·k = (W_ukᵀ q_nope)·c + q_r·k_r        out = W_uv (softmax(...) · c)

so one scaled-dot-product attention over the cached [c; k_r] (as a single shared key head, values = c)
replaces expanding the whole cache through kv_b_proj at every step.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specmoe.config import ModelConfig
from specmoe.models.kv_cache import KVCache
from specmoe.models.layers import RMSNorm
from specmoe.models.rope import apply_rope, deinterleave, yarn_mscale

# B=batch, T=tokens, S=key positions, D=hidden, H=heads, Dn/Dr/Dv=nope/rope/value head dims, C=kv_lora_rank

LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm / kv_a_layernorm with their default eps


class MLAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        ml, D, H = cfg.mla, cfg.hidden_size, cfg.num_heads
        self.cfg, self.ml = cfg, ml
        qk = ml.qk_nope_head_dim + ml.qk_rope_head_dim
        if ml.q_lora_rank is None:
            self.q_proj = nn.Linear(D, H * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(D, ml.q_lora_rank, bias=cfg.qkv_bias)
            self.q_a_norm = RMSNorm(ml.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(ml.q_lora_rank, H * qk, bias=False)
        self.kv_a_proj = nn.Linear(D, ml.kv_lora_rank + ml.qk_rope_head_dim, bias=cfg.qkv_bias)
        self.kv_a_norm = RMSNorm(ml.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(ml.kv_lora_rank, H * (ml.qk_nope_head_dim + ml.v_head_dim), bias=False)
        self.o_proj = nn.Linear(H * ml.v_head_dim, D, bias=cfg.o_proj_bias)
        self.scale = qk ** -0.5
        if cfg.yarn is not None and cfg.yarn.mscale_all_dim:
            self.scale *= yarn_mscale(cfg.yarn.factor, cfg.yarn.mscale_all_dim) ** 2

    def forward(self, x, cos, sin, mask, cache: KVCache, layer: int, bv, residual: torch.Tensor):
        ml, H = self.ml, self.cfg.num_heads
        B, T = bv.positions.shape  # x: [B·T, D], the forward's tokens flattened
        x = x.view(B, T, -1)
        cos, sin = cos.view(B, T, 1, -1), sin.view(B, T, 1, -1)  # [B, T, 1, Dr]
        Dn, Dr, C = ml.qk_nope_head_dim, ml.qk_rope_head_dim, ml.kv_lora_rank
        q = self.q_proj(x) if ml.q_lora_rank is None else self.q_b_proj(self.q_a_norm(self.q_a_proj(x)))
        q_nope, q_rot = q.view(B, T, H, Dn + Dr).split((Dn, Dr), dim=-1)  # [B, T, H, Dn], [B, T, H, Dr]
        c, k_rot = self.kv_a_proj(x).split((C, Dr), dim=-1)  # [B, T, C], [B, T, Dr]
        c = self.kv_a_norm(c)
        k_rot = k_rot[:, :, None, :]  # [B, T, 1, Dr]: one rotary key shared by the heads
        if self.cfg.rope_interleave:
            q_rot, k_rot = deinterleave(q_rot), deinterleave(k_rot)
        q_rot, k_rot = apply_rope(q_rot, cos, sin), apply_rope(k_rot, cos, sin)
        cache.write(layer, bv.write_index, torch.cat((c[:, :, None, :], k_rot), dim=-1).view(B * T, 1, 1, -1), None)
        keys, _ = cache.read(layer, bv.slots, bv.contiguous, bv.key_len)  # [B, 1, S, C + Dr]
        w = self.kv_b_proj.weight.view(H, Dn + ml.v_head_dim, C)
        q_lat = torch.einsum("bthn,hnc->bhtc", q_nope, w[:, :Dn])  # [B, H, T, C]: W_ukᵀ q_nope
        query = torch.cat((q_lat, q_rot.transpose(1, 2)), dim=-1)  # [B, H, T, C + Dr]
        out = F.scaled_dot_product_attention(query, keys, keys[..., :C], attn_mask=mask, scale=self.scale,
                                             enable_gqa=True)  # [B, H, T, C]
        out = torch.einsum("bhtc,hvc->bthv", out, w[:, Dn:])  # [B, T, H, Dv]: W_uv
        return residual + self.o_proj(out.reshape(B * T, H * ml.v_head_dim))
