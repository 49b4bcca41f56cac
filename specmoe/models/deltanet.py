"""Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5), as transformers' torch path computes it.

Per token: one projection gives q, k, v (through a causal depthwise conv of `conv_kernel` taps and SiLU), the
output gate z, and per value head b and a; β = σ(b), the decay g = -exp(A_log) · softplus(a + dt_bias). q and k
are L2-normalised (q also scaled by k_dim^-1/2), each key head serving num_v_heads / num_k_heads value heads. The
recurrent state S [value heads, k_dim, v_dim] follows the gated delta rule

    S ← S · exp(g);  S ← S + k ⊗ (β · (v − kᵀS));  out = qᵀS

and the output is RMSNorm(out) · w · silu(z) per value head, then out_proj. Decode, draft and verification
forwards run the recurrence as a plain loop over their tokens, keeping the state after each; a prefill of at
least `CHUNK` tokens runs the chunked form (`chunked`, the triangular-solve form transformers' torch path and FLA
use) and keeps the final state. The states live in the cache (`linear_state.py`): a forward reads each slot's
state at its start length and keeps the states after its tokens, so a speculative verification of T tokens keeps
all T and the commit picks the accepted one. Padding tokens of a ragged batch leave the state as it is (β = 0,
g = 0) and are never kept.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specmoe.config import ModelConfig
from specmoe.errors import UnsupportedModelError
from specmoe.models.kv_cache import KVCache
from specmoe.models.layers import addmm, linear, sigmoid, silu

# B=batch, T=tokens per row, N=B·T, D=hidden, C=conv channels, K=conv taps, Hk/Hv=key/value heads, Dk/Dv=head dims


class GatedDeltaNet(nn.Module):
    rows = 1  # see `layers.linear`; set on a deterministic model (`Transformer.set_deterministic`)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        la = self.la = cfg.linear_attention
        D, Hv, Dv = cfg.hidden_size, la.num_v_heads, la.v_head_dim
        self.eps = cfg.rms_norm_eps
        if la.split_projections:  # Qwen3.5
            self.in_proj_qkv = nn.Linear(D, la.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(D, Hv * Dv, bias=False)
            self.in_proj_b = nn.Linear(D, Hv, bias=False)
            self.in_proj_a = nn.Linear(D, Hv, bias=False)
        else:  # Qwen3-Next: grouped per key head
            self.in_proj_qkvz = nn.Linear(D, la.conv_dim + Hv * Dv, bias=False)
            self.in_proj_ba = nn.Linear(D, 2 * Hv, bias=False)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(la.conv_dim, 1, la.conv_kernel))
        self.A_log = nn.Parameter(torch.empty(Hv))
        self.dt_bias = nn.Parameter(torch.empty(Hv))
        self.norm = nn.Module()
        self.norm.weight = nn.Parameter(torch.empty(Dv))
        self.out_proj = nn.Linear(Hv * Dv, D, bias=False)
        self.in_proj: nn.Parameter | None = None  # [C + Hv·Dv + 2·Hv, D]: q, k, v, z, b, a (set by `fuse`)

    def _projection(self) -> torch.Tensor:
        """The checkpoint's input projections as one [q; k; v; z; b; a] weight (Qwen3-Next's grouped
        [q_g; k_g; v_g; z_g] per key head g and [b_g; a_g] regrouped into that order)."""
        la = self.la
        if la.split_projections:
            return torch.cat([self.in_proj_qkv.weight, self.in_proj_z.weight, self.in_proj_b.weight,
                              self.in_proj_a.weight])
        Hk, Dk, r = la.num_k_heads, la.k_head_dim, la.num_v_heads // la.num_k_heads
        rv = r * la.v_head_dim
        w = self.in_proj_qkvz.weight
        w = w.view(Hk, 2 * Dk + 2 * rv, w.shape[-1])
        q, k, v, z = w.split((Dk, Dk, rv, rv), dim=1)
        b, a = self.in_proj_ba.weight.view(Hk, 2 * r, -1).split((r, r), dim=1)
        return torch.cat([t.reshape(-1, w.shape[-1]) for t in (q, k, v, z, b, a)])

    def fuse(self) -> None:
        """After loading: one input projection (the separate ones are dropped, so nothing is held twice)."""
        self.in_proj = nn.Parameter(self._projection(), requires_grad=False)
        for name in (("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a") if self.la.split_projections
                     else ("in_proj_qkvz", "in_proj_ba")):
            delattr(self, name)

    def forward(self, x, cos, sin, mask, cache: KVCache, layer: int, bv, residual: torch.Tensor | None = None):
        """x [B·T, D] → residual + linear attention(x) [B·T, D]; `layer`: this layer's row in `cache.states`
        (cos, sin and mask are the attention layers' and unused here)."""
        la = self.la
        if bv.tree is not None:  # one token order per row: draft trees fall back to chains (`factory.tree_width`)
            raise UnsupportedModelError("linear attention verifies chains only, not token trees")
        B, T = bv.positions.shape
        C, K, Hk, Hv, Dk, Dv = la.conv_dim, la.conv_kernel, la.num_k_heads, la.num_v_heads, la.k_head_dim, la.v_head_dim
        dev = x.device
        w = self.in_proj if self.in_proj is not None else self._projection()
        qkv, z, b, a = linear(x, w, None, self.rows).split((C, Hv * Dv, Hv, Hv), dim=-1)
        start = (bv.write_positions if bv.write_positions is not None else bv.positions)[:, 0]  # [B] lengths
        slots = bv.slots if bv.slots is not None else torch.arange(bv.contiguous.start, bv.contiguous.stop,
                                                                   device=dev)
        states = cache.states
        if states is not None:
            conv0, S = states.read(layer, slots, start)
        else:  # a cache without states (a calibration forward): every row from zeros, nothing kept
            conv0 = torch.zeros(B, C, K - 1, dtype=x.dtype, device=dev)
            S = torch.zeros(B, Hv, Dk, Dv, device=dev)
        # causal depthwise conv over [state; new inputs]
        window = torch.cat((conv0.to(x.dtype), qkv.view(B, T, C).transpose(1, 2)), dim=2)  # [B, C, K-1+T]
        mixed = silu(F.conv1d(window, self.conv1d.weight, None, groups=C).transpose(1, 2))  # [B, T, C]
        q, k, v = mixed.float().split((Hk * Dk, Hk * Dk, Hv * Dv), dim=-1)
        r = Hv // Hk
        q = _l2norm(q.reshape(B, T, Hk, Dk)).repeat_interleave(r, dim=2) * Dk ** -0.5  # [B, T, Hv, Dk]
        k = _l2norm(k.reshape(B, T, Hk, Dk)).repeat_interleave(r, dim=2)
        v = v.reshape(B, T, Hv, Dv)
        beta = sigmoid(b).float().view(B, T, Hv)
        g = (-self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)).view(B, T, Hv)  # log decay
        lens = torch.full((B,), T, device=dev) if bv.valid is None else bv.valid.sum(1)  # real tokens per row
        if bv.valid is not None:  # padding leaves the state as it is: no decay, no write
            beta, g = beta * bv.valid[..., None], g * bv.valid[..., None]
        # a forward shorter than the ring (decode, draft, verification) keeps the state after each of its tokens; a
        # longer one (a prefill, committed whole) keeps each row's state after its last token
        keep_all = states is not None and T < states.ring
        n = T if keep_all else 1  # states kept per row: after its last n tokens
        first_kept = lens - n  # [B]: token index of the first kept state per row (may be < 0: keep from 0)
        ragged = bv.valid is not None  # without padding every row keeps every state (no mask to apply)
        if keep_all:
            def keep(t, S_t):
                states.write_recurrent(layer, slots, start + t + 1, S_t,
                                       (t >= first_kept) & (t < lens) if ragged else None)
            out, S = recurrent(q, k, v, g, beta, S, keep)
        else:
            out, S = prefill(q, k, v, g, beta, S, lens, min_chunked=max(CHUNK, states.ring if states else 0))
        if states is not None and not keep_all:  # padding kept it: S is each row's state after its last token
            states.write_recurrent(layer, slots, start + lens, S)
        if states is not None:  # conv states after the same tokens: the last K-1 inputs through each
            j = first_kept[:, None] + torch.arange(n, device=dev)[None, :]  # [B, n] token indices
            cols = (j.clamp(min=0) + 1)[:, :, None] + torch.arange(K - 1, device=dev)  # [B, n, K-1] window columns
            conv = torch.gather(window[:, None].expand(B, n, C, -1), 3, cols[:, :, None, :].expand(B, n, C, K - 1))
            states.write_conv(layer, slots, start[:, None] + j + 1, conv, (j >= 0) if ragged else None)
        o = out.to(x.dtype).reshape(-1, Dv)  # gated RMSNorm per value head, as transformers rounds it
        o = self.norm.weight * F.rms_norm(o.float(), (Dv,), None, self.eps).to(x.dtype)
        o = o * silu(z.reshape(-1, Dv).float())
        o = o.to(x.dtype).view(B * T, Hv * Dv)
        if residual is None:
            return linear(o, self.out_proj.weight, None, self.rows)
        return addmm(residual, o, self.out_proj.weight.t(), self.rows)


CHUNK = 64  # tokens per chunk of the chunked form


def recurrent(q, k, v, g, beta, S, keep=None):
    """The gated delta rule token by token (the recurrent form): q, k [B, T, H, Dk] (normalised, q scaled), v
    [B, T, H, Dv], g (log decay) and beta [B, T, H], S [B, H, Dk, Dv] fp32 → (out [B, T, H, Dv], the state after
    the last token); `keep(t, S)` sees the state after each token t."""
    B, T, H, Dv = v.shape
    out = torch.empty(B, T, H, Dv, device=v.device)
    decay = g.exp()
    for t in range(T):
        S = S * decay[:, t, :, None, None]
        kt = k[:, t]
        delta = (v[:, t] - (S * kt[..., None]).sum(-2)) * beta[:, t, :, None]  # [B, H, Dv]
        S = S + kt[..., None] * delta[:, :, None, :]
        out[:, t] = (S * q[:, t, :, :, None]).sum(-2)
        if keep is not None:
            keep(t, S)
    return out, S


def prefill(q, k, v, g, beta, S, lens, min_chunked: int):
    """A prefill forward (no state kept but the last): rows of at least `min_chunked` real tokens take the chunked
    form, the others the recurrent one over their own length; the choice is each row's own, so a row's bits do
    not depend on the rows beside it. Padding (after a row's real tokens) leaves the state as it is."""
    B, T = v.shape[:2]
    if T < min_chunked:
        return recurrent(q, k, v, g, beta, S)
    long = lens >= min_chunked
    idx = long.nonzero()[:, 0].tolist()
    if len(idx) == B:
        return chunked(q, k, v, g, beta, S)
    out = torch.zeros(v.shape, device=v.device)  # a short row's padding past its longest stays 0
    S_out = torch.empty_like(S)
    short = (~long).nonzero()[:, 0]
    Ts = int(lens[short].max())  # the short rows stop at their longest's length
    parts = [(short, recurrent(*(x[short, :Ts] for x in (q, k, v, g, beta)), S[short]), Ts)]
    if idx:
        li = torch.tensor(idx, device=v.device)
        parts.append((li, chunked(*(x[li] for x in (q, k, v, g, beta)), S[li]), T))
    for rows, (o, s), n in parts:
        out[rows, :n] = o
        S_out[rows] = s
    return out, S_out


def chunked(q, k, v, g, beta, S, chunk: int = CHUNK):
    """The gated delta rule over T tokens in chunks (the WY / UT form transformers' torch path and FLA use): within
    a chunk the updates are solved as one triangular system, across chunks the state carries. q, k [B, T, H, Dk]
    (normalised, q scaled), v [B, T, H, Dv], g (log decay) and beta [B, T, H], S [B, H, Dk, Dv] fp32 →
    (out [B, T, H, Dv], the state after the last token). Zero padding to whole chunks changes nothing (k = 0,
    β = 0, g = 0)."""
    B, T, H, Dk = k.shape
    pad = -T % chunk
    q, k, v, g, beta = (F.pad(x.transpose(1, 2), (0, 0, 0, pad) if x.dim() == 4 else (0, pad))
                        for x in (q, k, v, g, beta))  # [B, H, T', ...]
    n = (T + pad) // chunk
    k_beta, v_beta = k * beta[..., None], v * beta[..., None]
    q, k, k_beta, v_beta = (x.reshape(B, H, n, chunk, -1) for x in (q, k, k_beta, v_beta))
    cum = g.reshape(B, H, n, chunk).cumsum(-1)  # [B, H, n, C]
    upper = torch.triu(torch.ones(chunk, chunk, dtype=torch.bool, device=k.device))
    strict = torch.triu(upper, diagonal=1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(strict, float("-inf")).exp()  # [B, H, n, C, C]
    attn = -((k_beta @ k.transpose(-1, -2)) * decay).masked_fill(upper, 0)
    for i in range(1, chunk):  # forward substitution: (I + A)⁻¹ row by row
        attn[..., i, :i] = attn[..., i, :i] + (attn[..., i, :i, None] * attn[..., :i, :i]).sum(-2)
    attn = attn + torch.eye(chunk, device=k.device)
    value = attn @ v_beta
    k_cumdecay = attn @ (k_beta * cum.exp()[..., None])
    out = torch.empty_like(value)
    for i in range(n):
        qi, ki = q[:, :, i], k[:, :, i]
        inner = (qi @ ki.transpose(-1, -2) * decay[:, :, i]).masked_fill(strict, 0)
        v_new = value[:, :, i] - k_cumdecay[:, :, i] @ S
        out[:, :, i] = (qi * cum[:, :, i, :, None].exp()) @ S + inner @ v_new
        last = cum[:, :, i, -1]
        S = S * last.exp()[..., None, None] + (ki * (last[..., None] - cum[:, :, i]).exp()[..., None]).transpose(
            -1, -2) @ v_new
    return out.reshape(B, H, -1, out.shape[-1])[:, :, :T].transpose(1, 2), S


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(Σx² + eps) over the last dim (transformers' and FLA's l2norm)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
