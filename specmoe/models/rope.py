"""Rotary position embeddings: inverse frequencies (plain or YaRN-scaled, over the rotating part of a head)
and their application in the half-split layout transformers uses (`rotate_half`).

Llama-3-style scaling (Llama-4) rescales the plain frequencies by wavelength (`_llama3`). Partial rotary (GLM-4,
MiniMax-M2) rotates the first `cfg.rotary_dim` dims of a head and passes the rest through;
DeepSeek's and Llama-4's interleaved pairs are de-interleaved by the caller (`deinterleave`) first, which gives the
same dot products. YaRN follows transformers' `_compute_yarn_parameters` (frequency ramp between the
beta_fast / beta_slow correction dims, cos and sin scaled by the attention factor).
"""
from __future__ import annotations

import math

import torch

from specmoe.config import Llama3Rope, ModelConfig, Yarn

# B=batch, T=tokens, R=rotating dims of a head


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(y: Yarn, base: float, dim: int, device) -> tuple[torch.Tensor, float]:
    attention_factor = y.attention_factor
    if attention_factor is None:
        attention_factor = (yarn_mscale(y.factor, y.mscale) / yarn_mscale(y.factor, y.mscale_all_dim)
                            if y.mscale and y.mscale_all_dim else yarn_mscale(y.factor))

    def correction_dim(rotations: float) -> float:
        return dim * math.log(y.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(y.beta_fast), correction_dim(y.beta_slow)
    if y.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no singularity
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1).to(device)
    pos_freqs = base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    extrapolation = 1 - ramp  # share of the unscaled frequency per dim pair
    inv_freq = (1.0 / (y.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


def _llama3(r: Llama3Rope, freqs: torch.Tensor) -> torch.Tensor:
    """transformers' `_compute_llama3_parameters` over the plain inverse frequencies."""
    old = r.original_max_position_embeddings
    low_wavelen, high_wavelen = old / r.low_freq_factor, old / r.high_freq_factor
    wavelen = 2 * math.pi / freqs
    scaled = torch.where(wavelen > low_wavelen, freqs / r.factor, freqs)
    smooth = (old / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
    smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def inv_freq(cfg: ModelConfig, device) -> tuple[torch.Tensor, float]:
    """(inverse frequencies [R/2] fp32, factor scaling cos and sin)."""
    dim = cfg.rotary_dim
    if cfg.yarn is not None:
        return _yarn(cfg.yarn, cfg.rope_theta, dim, device)
    freqs = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
    if cfg.llama3_rope is not None:
        freqs = _llama3(cfg.llama3_rope, freqs)
    return freqs, 1.0


def rope_tables(positions: torch.Tensor, freqs: torch.Tensor, scaling: float, dtype: torch.dtype):
    """cos and signed sin ([-sin, sin] over the two halves, see `apply_rope`) for [B, T] positions as
    [B, T, 1, R] (fp32 math, cast like transformers)."""
    angles = positions[..., None].float() * freqs  # [B, T, R/2]
    cos = torch.cat((angles, angles), dim=-1).cos()[:, :, None, :]
    sin = angles.sin()[:, :, None, :]
    sin = torch.cat((-sin, sin), dim=-1)
    if scaling != 1.0:
        cos, sin = cos * scaling, sin * scaling
    return cos.to(dtype), sin.to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin_signed: torch.Tensor) -> torch.Tensor:
    """x·cos + rotate_half(x)·sin on the first R dims of x (HF's half-split layout), the rest passed through.
    rotate_half(x) = [-x2, x1] equals roll(x, R/2) = [x2, x1] times the signs [-1, +1] that `sin_signed`
    carries, so the rotation is three ops."""
    R = cos.shape[-1]
    if R == x.shape[-1]:
        return torch.addcmul(x * cos, x.roll(R // 2, dims=-1), sin_signed)
    rot = x[..., :R]
    return torch.cat((torch.addcmul(rot * cos, rot.roll(R // 2, dims=-1), sin_signed), x[..., R:]), dim=-1)


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Pairs (x0, x1), (x2, x3), ... → [x0, x2, ...; x1, x3, ...]: interleaved rotary dims in the half-split
    layout (DeepSeek's `rope_interleave`)."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
