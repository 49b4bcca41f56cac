"""Layers shared by the decoder and the MoE block (RMSNorm, the dense SwiGLU MLP, the embedding),
in their own module so that `moe` and `decoder` import downward only."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# D=hidden


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x·rsqrt(mean(x²) + eps)·weight in fp32 (one fused op); in another dtype normalised in fp32, rounded,
        then scaled by the weight, as transformers does."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)


class DenseMLP(nn.Module):
    def __init__(self, dim: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, inter, bias=False)
        self.up_proj = nn.Linear(dim, inter, bias=False)
        self.down_proj = nn.Linear(inter, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Embedding(nn.Module):
    """Token embedding without nn.Embedding's random init (which, on `meta`, pulls in torch._refs: seconds)."""

    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, dim))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.weight)
