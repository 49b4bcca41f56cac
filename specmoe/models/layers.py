"""Layers shared by the decoder and the MoE block (RMSNorm, the dense SwiGLU MLP, the embedding),
in their own module so that `moe` and `decoder` import downward only."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specmoe import kernels as native
from specmoe.models.orientation import use_weight_major, weight_major

# D=hidden, N=rows (tokens)


VEC_BLOCK = 32  # fp32 elements per step of CPU elementwise loops (2 vectors of 16 with AVX-512, of 8 with AVX2)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """torch.sigmoid with a result per element that does not depend on where the element sits in the tensor. CPU
    fp32 sigmoid/silu compute the last (numel mod VEC_BLOCK) elements on a scalar path that rounds differently, so a
    row's bits would depend on whether it is the tensor's last; where the last dim is not a multiple of VEC_BLOCK
    (only then can a row hold that tail) this computes 1 / (1 + exp(-x)) instead (exp is vectorised to the end)."""
    if x.dtype != torch.float32 or x.shape[-1] % VEC_BLOCK == 0:
        return torch.sigmoid(x)
    return 1 / (1 + torch.exp(-x))


def silu(x: torch.Tensor) -> torch.Tensor:
    """F.silu, placed like `sigmoid`."""
    if x.dtype != torch.float32 or x.shape[-1] % VEC_BLOCK == 0:
        return F.silu(x)
    return x * sigmoid(x)


ONEDNN_MIN = 16 ** 3  # bf16/fp16 CPU matmuls run in oneDNN above this many (batch ×) rows × inner × outer, else not


def min_rows(dtype: torch.dtype, inner_outer: int, rows: int = 1) -> int:
    """Rows a matmul with `inner_outer` (= inner × outer) multiply-adds per row is given at least, so that a row's
    kernel, hence its bits, does not depend on how many rows come with it: fp32, `rows` (in a deterministic model
    `rowclasses.deterministic_rows()`, measured on this machine); bf16/fp16, enough to stay above oneDNN's threshold
    (1 for any real model's sizes)."""
    if dtype == torch.float32:
        return rows
    return ONEDNN_MIN // inner_outer + 1


def native_rows_alike(x: torch.Tensor, rows: int) -> bool:
    """Whether a native product must give every row the bits it gets alone at any row count (never BLAS above
    `kernels.BLAS_ROWS` rows, whose rounding differs): a deterministic model (`rows` > 1), and every half-precision
    model, whose forwards are batch-invariant by default (bf16 verification of 64 sequences × 3 positions put more
    than 16 rows on an expert and flipped a greedy token against plain decoding, which put fewer)."""
    return rows > 1 or x.dtype in (torch.bfloat16, torch.float16)


def native_invariant(x: torch.Tensor, rows: int) -> bool:
    """A deterministic model (`rows` > 1) computing fp32 on a CPU with the native kernels: they give every row the bits
    it gets alone at any row count (no padding; padding `F.linear` to a measured row class did not cover every shape,
    e.g. a one-output gate at one thread)."""
    return rows > 1 and x.dtype == torch.float32 and x.device.type == "cpu" and native.available()


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None, rows: int = 1) -> torch.Tensor:
    """F.linear, with an input of fewer than `min_rows` rows padded with zero rows first: each row goes through the
    kernel that many rows get, so its result does not depend on how many rows came with it. A model that is not
    deterministic (`rows` 1) computes 2 rows or more weight-major where this CPU is faster so (`orientation`)."""
    if w.dtype != x.dtype or native_invariant(x, rows):  # a stored-dtype weight (`keep_stored`), or fp32 deterministic
        return native.linear(x, w, b, invariant=native_rows_alike(x, rows))
    n = x.shape[0] if x.dim() == 2 else x.numel() // x.shape[-1]
    if rows == 1 and n >= 2 and use_weight_major(x, w.numel()):
        y = weight_major(x.reshape(n, x.shape[-1]), w, b)
        return y.view(*x.shape[:-1], y.shape[-1])
    if n >= rows if x.dtype == torch.float32 else n * w.shape[0] * w.shape[1] > ONEDNN_MIN:  # no padding (the rule)
        return F.linear(x, w, b)
    need = min_rows(x.dtype, w.shape[0] * w.shape[1], rows)
    y = F.linear(F.pad(x.reshape(n, x.shape[-1]), (0, 0, 0, need - n)), w, b)[:n]
    return y.view(*x.shape[:-1], y.shape[-1])


def addmm(acc: torch.Tensor, x: torch.Tensor, w_t: torch.Tensor, rows: int = 1) -> torch.Tensor:
    """acc + x @ w_t (one addmm), padded like `linear` (or weight-major like it): acc [N, O], x [N, I], w_t [I, O]."""
    if w_t.dtype != x.dtype or native_invariant(x, rows):  # stored dtype, or fp32 deterministic: native
        return acc + native.linear(x, w_t.t(), None, invariant=native_rows_alike(x, rows))
    n = x.shape[0]
    if rows == 1 and n >= 2 and use_weight_major(x, w_t.numel()):
        return torch.addmm(acc.t(), w_t.t(), x.t()).t().contiguous()
    if n >= rows if x.dtype == torch.float32 else n * w_t.shape[0] * w_t.shape[1] > ONEDNN_MIN:
        return torch.addmm(acc, x, w_t)
    need = min_rows(x.dtype, w_t.shape[0] * w_t.shape[1], rows)
    return torch.addmm(F.pad(acc, (0, 0, 0, need - n)), F.pad(x, (0, 0, 0, need - n)), w_t)[:n]


def set_min_rows(model: nn.Module, rows: int) -> None:
    """Set `rows` (see `linear`) on every module of `model` that has one (a `deterministic` model:
    `rowclasses.deterministic_rows()`)."""
    for m in model.modules():
        if hasattr(m, "rows"):
            m.rows = rows


class LayerNorm(nn.Module):
    """LayerNorm with weight and bias (NLLB-MoE), built without nn.LayerNorm's init (the loader assigns both)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.empty(dim)), nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    """`offset`: zero-centred (Qwen3-Next, Qwen3.5): the stored weight w scales by (1 + w), in fp32 before the
    result is rounded, as transformers does; the fp32 scale is made once by `fuse` after loading."""

    def __init__(self, dim: int, eps: float, offset: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.offset = eps, offset
        self.scale: torch.Tensor | None = None  # offset: 1 + weight in fp32 (set by `fuse`)

    def fuse(self) -> None:
        if self.offset:
            self.scale = 1.0 + self.weight.float()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x·rsqrt(mean(x²) + eps)·weight in fp32 (one fused op); in another dtype normalised in fp32, rounded,
        then scaled by the weight, as transformers does (zero-centred: scaled in fp32, then rounded)."""
        native_path = x.dtype == torch.float32 and x.device.type == "cpu" and native.available()
        if self.offset:
            scale = self.scale if self.scale is not None else 1.0 + self.weight.float()
            if native_path:
                return native.rms_norm(x, scale, self.eps)
            return F.rms_norm(x.float(), self.weight.shape, scale, self.eps).to(x.dtype)
        if x.dtype == torch.float32:
            if native_path:  # one native op (the torch one dispatches five for a decode row's few hundred values)
                return native.rms_norm(x, self.weight, self.eps)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)


class DenseMLP(nn.Module):
    rows = 1  # see `linear`; set on a deterministic model (`Transformer.set_deterministic`)

    def __init__(self, dim: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(dim, inter, bias=False)
        self.up_proj = nn.Linear(dim, inter, bias=False)
        self.down_proj = nn.Linear(inter, dim, bias=False)

    def keep_stored(self, dtype: torch.dtype) -> None:
        """Hold the projections in `dtype` (the checkpoint's; `linear` then computes natively from it)."""
        for p in (self.gate_proj, self.up_proj, self.down_proj):
            p.weight = nn.Parameter(p.weight.to(dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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
