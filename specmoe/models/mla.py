"""Multi-head latent attention (DeepSeek-V2/V3, Kimi-K2) with a compressed KV cache.

Keys and values of all heads are linear in one per-token latent c (kv_lora_rank dims, after its RMSNorm)
plus one rotary key k_r shared by the heads (qk_rope_head_dim dims). The cache holds [c; k_r] per position,
one "head" of kv_lora_rank + qk_rope_head_dim values, never the expanded per-head K and V. Attention is
computed in the latent space ("absorbed"): with kv_b_proj = [W_uk; W_uv] per head,

    q·k = (W_ukᵀ q_nope)·c + q_r·k_r        out = W_uv (softmax(...) · c)

so one attention (`attention.attend`) over the cached [c; k_r] (as a single shared key head, values = c)
replaces expanding the whole cache through kv_b_proj at every step.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specmoe.config import ModelConfig
from specmoe.models.attention import BMM_LOOP, attention, fixed_split, read_keys
from specmoe.models.kv_cache import KVCache
from specmoe.models.layers import ONEDNN_MIN, RMSNorm, linear
from specmoe.models.rope import apply_rope, deinterleave, yarn_mscale

# B=batch, T=tokens, S=key positions, D=hidden, H=heads, Dn/Dr/Dv=nope/rope/value head dims, C=kv_lora_rank

LATENT_NORM_EPS = 1e-6  # transformers builds q_a_layernorm / kv_a_layernorm with their default eps


def _lin(mod: nn.Linear, x: torch.Tensor, rows: int) -> torch.Tensor:
    return linear(x, mod.weight, mod.bias, rows)


def _per_head(eq: str, x: torch.Tensor, w: torch.Tensor, rows: int) -> torch.Tensor:
    """einsum(eq, x, w) over x [N, H, I] and per-head weights w [H, ·, ·] (a matmul of N rows per head) → [N, H, O];
    fp32 with `rows` > 1: N padded like `layers.linear`."""
    n, H, io = x.shape[0], w.shape[0], w.shape[1] * w.shape[2]
    # and never where a bmm of H heads changes kernel (attention.BMM_LOOP, layers.ONEDNN_MIN): tiny heads only
    rows = max(-(-BMM_LOOP // io), rows if x.dtype == torch.float32 else ONEDNN_MIN // (H * io) + 1)
    if n >= rows:
        return torch.einsum(eq, x, w)
    return torch.einsum(eq, F.pad(x, (0, 0, 0, 0, 0, rows - n)), w)[:n]


class MLAttention(nn.Module):
    rows = 1  # see `layers.linear`; set on a deterministic model

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
        r = self.rows
        q = _lin(self.q_proj, x, r) if ml.q_lora_rank is None else \
            _lin(self.q_b_proj, self.q_a_norm(_lin(self.q_a_proj, x, r)), r)
        q_nope, q_rot = q.view(B, T, H, Dn + Dr).split((Dn, Dr), dim=-1)  # [B, T, H, Dn], [B, T, H, Dr]
        c, k_rot = _lin(self.kv_a_proj, x, r).split((C, Dr), dim=-1)  # [B, T, C], [B, T, Dr]
        c = self.kv_a_norm(c)
        k_rot = k_rot[:, :, None, :]  # [B, T, 1, Dr]: one rotary key shared by the heads
        if self.cfg.rope_interleave:
            q_rot, k_rot = deinterleave(q_rot), deinterleave(k_rot)
        q_rot, k_rot = apply_rope(q_rot, cos, sin), apply_rope(k_rot, cos, sin)
        cache.write(layer, bv.write_index, torch.cat((c[:, :, None, :], k_rot), dim=-1).view(B * T, 1, 1, -1), None)
        fixed = fixed_split(c, r)
        keys, _ = read_keys(cache, layer, bv, fixed)  # [B, 1, S, C + Dr], S: key_len (rounded up to a block)
        w = self.kv_b_proj.weight.view(H, Dn + ml.v_head_dim, C)
        q_lat = _per_head("nhd,hdc->nhc", q_nope.reshape(B * T, H, Dn), w[:, :Dn], r)  # [B·T, H, C]: W_ukᵀ q_nope
        query = torch.cat((q_lat.view(B, T, H, C), q_rot), dim=-1).transpose(1, 2)  # [B, H, T, C + Dr]
        out = attention(query, keys, keys[..., :C], mask, self.scale, bv.key_len, invariant=fixed)  # [B, H, T, C]
        out = _per_head("nhc,hvc->nhv", out.transpose(1, 2).reshape(B * T, H, C), w[:, Dn:], r)  # [B·T, H, Dv]: W_uv
        return residual + _lin(self.o_proj, out.reshape(B * T, H * ml.v_head_dim), r)
