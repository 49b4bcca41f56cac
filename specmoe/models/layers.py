"""Layers shared by the decoder and the MoE block (RMSNorm, the dense SwiGLU MLP, the embedding),
in their own module so that `moe` and `decoder` import downward only."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# D=hidden, N=rows (tokens)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """torch.sigmoid with a result per element that does not depend on where the element sits in the tensor. CPU
    fp32 sigmoid/silu compute the last (numel mod 2·vector width) elements on a scalar path that rounds differently,
    so a row's bits would depend on whether it is the tensor's last; where the last dim is not a multiple of 64 (only
    then can a row hold that tail) this computes 1 / (1 + exp(-x)) instead (exp is vectorised to the end)."""
    if x.dtype != torch.float32 or x.shape[-1] % 64 == 0:
        return torch.sigmoid(x)
    return 1 / (1 + torch.exp(-x))


def silu(x: torch.Tensor) -> torch.Tensor:
    """F.silu, placed like `sigmoid`."""
    if x.dtype != torch.float32 or x.shape[-1] % 64 == 0:
        return F.silu(x)
    return x * sigmoid(x)


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, rows: int = 1) -> torch.Tensor:
    """F.linear. With `rows` > 1 (a `deterministic` model, see `attention.MIN_ROWS`) an fp32 input of fewer rows is
    padded with zero rows first, so each row goes through the kernel that `rows` or more rows get (CPU sgemm rounds
    a row differently at 1, 2-3 and >= 4 rows): its result no longer depends on how many rows came with it."""
    n = x.numel() // x.shape[-1] if x.dim() != 2 else x.shape[0]
    if n >= rows or x.dtype != torch.float32:
        return F.linear(x, w, b)
    y = F.linear(F.pad(x.reshape(n, x.shape[-1]), (0, 0, 0, rows - n)), w, b)[:n]
    return y.view(*x.shape[:-1], y.shape[-1])


def addmm(acc: torch.Tensor, x: torch.Tensor, w_t: torch.Tensor, rows: int = 1) -> torch.Tensor:
    """acc + x @ w_t (one addmm), padded like `linear`: acc [N, O], x [N, I], w_t [I, O]."""
    n = x.shape[0]
    if n >= rows or x.dtype != torch.float32:
        return torch.addmm(acc, x, w_t)
    return torch.addmm(F.pad(acc, (0, 0, 0, rows - n)), F.pad(x, (0, 0, 0, rows - n)), w_t)[:n]


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
    rows = 1  # see `linear`; set on a deterministic model (`Transformer.set_deterministic`)

    def __init__(self, dim: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, inter, bias=False)
        self.up_proj = nn.Linear(dim, inter, bias=False)
        self.down_proj = nn.Linear(inter, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rows == 1:
            return self.down_proj(silu(self.gate_proj(x)) * self.up_proj(x))
        r = self.rows
        g, u = linear(x, self.gate_proj.weight, None, r), linear(x, self.up_proj.weight, None, r)
        return linear(silu(g) * u, self.down_proj.weight, None, r)


class Embedding(nn.Module):
    """Token embedding without nn.Embedding's random init (which, on `meta`, pulls in torch._refs: seconds)."""

    def __init__(self, vocab: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, dim))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return F.embedding(tokens, self.weight)
