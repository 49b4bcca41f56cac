"""Attention: the batch-invariant kernel `attend` (a row's output, to the bit, does not depend on the batch's other
rows, on how many positions the forward verifies, or on how many key positions the batch spans), and `attention`,
which every forward calls: `attend` for bf16/fp16 on CPU always, for fp32 and CUDA in a `deterministic` model,
else PyTorch's SDPA.

`F.scaled_dot_product_attention` is not batch-invariant: its reductions over the keys are blocked by the batch's
key length (S, the longest row's), and its query blocking by the forward's query count, so the same query over the
same keys rounds differently in a batch of other lengths, in a verification forward of another size, or in a
prefill padded to a longer prompt (measured on CPU, bf16 and fp32; bf16 greedy tokens flipped at near-ties).

`attend` fixes the reduction order instead (the fixed split): keys are cut into blocks of `CHUNK` positions at
absolute positions 0, CHUNK, 2·CHUNK, …; every matmul has the same shape whatever the batch (q·kᵀ per block:
Dh → CHUNK; p·V per block: CHUNK → Dv), the softmax max is a max (exact in any order), and the blocks' partial sums
are added in position order by a sequential `cumsum` (double accumulation on CPU), where a block past a row's last
visible key adds an exact zero. Queries are rows of the matmuls: their count only picks the matmul's kernel, so
they are padded to the count that keeps every row on one kernel (`min_rows`: in fp32 the count measured on this
machine, `rowclasses.deterministic_rows()`, 4 to 16 rows where CPU sgemm changes kernel; in bf16 enough to stay on
oneDNN, 1 at real head sizes). Softmax math is fp32;
q·kᵀ and p·V run in the input dtype (bf16 logits are rounded to bf16 first, as transformers' eager attention does,
and each block's p·V too).

GPT-OSS's sinks: every head has a learned logit, its *sink*, that joins each query's softmax as an extra key with a
zero value (it takes a share of the probability mass and returns nothing).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specmoe.models.layers import ONEDNN_MIN
from specmoe.models.rowclasses import deterministic_rows

# B=batch, Hq/Hkv=query/key heads, G=Hq/Hkv, T=queries, S=keys (a multiple of CHUNK), Dh/Dv=key/value head dims,
# n=key blocks, M=G·T query rows per key head (padded to R)

CHUNK = 128  # key positions per block of the fixed split (128 measured faster than 64 and 256 on the demo model)
# CPU bmm picks its kernel by size: bf16/fp16 take oneDNN when batch × rows × contraction × columns exceeds
# layers.ONEDNN_MIN; otherwise (and fp32) a plain loop when contraction × rows × columns is under BMM_LOOP, else
# BLAS. Query rows are padded so that no row changes kernel with its neighbours' count (`min_rows`)
BMM_LOOP = 400
MAX_LOGITS = 1 << 24  # logits (fp32) held at once; longer prefills attend in query blocks (same bits)


def padded_keys(S: int) -> int:
    """Key positions a forward attends over for S real ones: S rounded up to a whole block."""
    return -(-max(S, 1) // CHUNK) * CHUNK


def read_keys(cache, layer: int, bv, fixed: bool = True):
    """Keys and values (None: a keys-only cache) of a forward's slots (`decoder.BatchView` bv) over
    `padded_keys(bv.key_len)` positions, what `attend` reads (the positions past key_len are hidden):
    [B, Hkv, S, Dh] each, zero-padded where the cache holds fewer positions; not `fixed` (SDPA): key_len."""
    if not fixed:
        return cache.read(layer, bv.slots, bv.contiguous, bv.key_len)
    S = padded_keys(bv.key_len)
    k, v = cache.read(layer, bv.slots, bv.contiguous, S)
    if k.shape[2] < S:
        k = F.pad(k, (0, 0, 0, S - k.shape[2]))
        v = None if v is None else F.pad(v, (0, 0, 0, S - v.shape[2]))
    return k, v


def fixed_split(q: torch.Tensor, rows: int) -> bool:
    """Whether a forward's attention takes the fixed split: always for bf16 / fp16 on CPU (where the rest of the
    forward is batch-invariant too; on the demo model the split costs a few % at batch 1 and gains from batch 16, see
    benchmarks/results/determinism.json); for fp32 and on CUDA only in a `deterministic` model (`rows` > 1): there
    SDPA is faster, and without the option the GEMMs are not batch-invariant anyway."""
    return rows > 1 or (q.dtype != torch.float32 and q.device.type == "cpu")


def min_rows(dtype: torch.dtype, d: int) -> int:
    """Query rows per matmul at least (d: the smaller head dim), so that a row's matmul never changes kernel with
    the count of rows beside it: fp32 matmuls' row classes (`rowclasses.deterministic_rows()`, measured on this
    machine); bmm's plain loop (BMM_LOOP); bf16/fp16 bmm's oneDNN threshold (ONEDNN_MIN: batch × rows ×
    contraction × columns above it, else another kernel)."""
    r = -(-BMM_LOOP // (CHUNK * d))
    if dtype == torch.float32:
        return max(r, deterministic_rows())
    return max(r, ONEDNN_MIN // (CHUNK * d) + 1)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
              key_len: int, sinks: torch.Tensor | None = None, invariant: bool = True) -> torch.Tensor:
    """What a forward's attention calls: `attend` (batch-invariant); with `invariant` False and no sinks (fp32 without
    `deterministic`, whose GEMMs are not batch-invariant anyway), PyTorch's SDPA over the key_len real positions,
    which is faster there. Shapes as in `attend`; k, v over `padded_keys(key_len)` positions for `attend`, key_len
    for SDPA (`read_keys`)."""
    if invariant or sinks is not None:
        return attend(q, k, v, mask, scale, sinks, visible=key_len)
    return F.scaled_dot_product_attention(q, k, v, scale=scale, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


# ((mask, G, R, hidden-key mask in the blocked layout), ...): the last few conversions, newest first (every layer of
# a forward passes the mask object of its attention kind: one, or a few where layers differ, as Llama-4's chunked and
# full layers)
_HIDE: tuple = ()
_HIDE_KEEP = 4


def _hidden(mask: torch.Tensor, n: int, G: int, R: int) -> torch.Tensor:
    """mask [B, 1, T, S <= n·CHUNK] (True = visible) → True where hidden, [B, 1, n, R, CHUNK] (rows (g, t), then
    R - G·T padding rows that see every key)."""
    kept = _HIDE
    for m, g, r, hide in kept:
        if m is mask and g == G and r == R:
            return hide
    B, _, T, S = mask.shape
    full = F.pad(mask, (0, n * CHUNK - S), value=False) if S < n * CHUNK else mask  # keys past the mask's: hidden
    hide = ~full.reshape(B, 1, T, n, CHUNK).transpose(2, 3)  # [B, 1, n, T, CHUNK]
    if G > 1:
        hide = hide[:, :, :, None].expand(B, 1, n, G, T, CHUNK).reshape(B, 1, n, G * T, CHUNK)
    if R > G * T:
        hide = F.pad(hide, (0, 0, 0, R - G * T), value=False)
    globals()["_HIDE"] = ((mask, G, R, hide),) + kept[:_HIDE_KEEP - 1]
    return hide


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
           sinks: torch.Tensor | None = None, visible: int | None = None) -> torch.Tensor:
    """q [B, Hq, T, Dh], k [B, Hkv, S, Dh] and v [B, Hkv, S, Dv] (S a multiple of CHUNK; any strides whose
    position dim can be split), mask [B, 1, T, S'] bool (True = visible; S' <= S, keys past S' are hidden) or
    None (every key below `visible` is visible, default all S), sinks [Hq] or None → [B, Hq, T, Dv] in q's dtype."""
    B, Hq, T, Dh = q.shape
    Hkv, S, Dv = k.shape[1], k.shape[2], v.shape[-1]
    G = Hq // Hkv
    step = max(1, MAX_LOGITS // max(1, B * Hkv * G * S))  # queries per block of a long prefill
    if T > step:
        return torch.cat([attend(q[:, :, t:t + step], k, v, None if mask is None else mask[:, :, t:t + step],
                                 scale, sinks, visible) for t in range(0, T, step)], dim=2)
    n, M = S // CHUNK, G * T
    R = max(M, min_rows(q.dtype, min(Dh, Dv)))
    N = B * Hkv * n  # matmuls of each kind, one per (row, key head, block), all of one shape
    qg = (q * scale).reshape(B, Hkv, M, Dh)  # rows (g, t): the query heads sharing a key head
    if R > M:
        qg = F.pad(qg, (0, 0, 0, R - M))
    # (reshape: with one query head per key head and no padding rows, q may still be the caller's transposed view)
    qg = qg.reshape(N, R, Dh) if n == 1 else qg[:, :, None].expand(B, Hkv, n, R, Dh).reshape(N, R, Dh)
    s = torch.bmm(qg, k.reshape(N, CHUNK, Dh).transpose(1, 2)).view(B, Hkv, n, R, CHUNK).float()
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    if mask is not None:
        hide = _hidden(mask, n, G, R)
        s = s.masked_fill(hide, float("-inf")) if grad else s.masked_fill_(hide, float("-inf"))
    elif visible is not None and visible < S:  # the last block's tail
        s[:, :, -1, :, visible - (n - 1) * CHUNK:] = float("-inf")
    m = s.amax(dim=(2, 4), keepdim=True)  # [B, Hkv, 1, R, 1]: exact in any order
    if sinks is not None:
        sink = sinks.float().view(Hkv, G, 1).expand(Hkv, G, T).reshape(1, Hkv, 1, M, 1)
        if R > M:
            sink = F.pad(sink, (0, 0, 0, R - M), value=float("-inf"))
        m = torch.maximum(m, sink)
    p = torch.exp(s - m) if grad else s.sub_(m).exp_()  # hidden keys: exactly 0
    den = p.sum(-1)  # [B, Hkv, n, R]: one block, a fixed-size sum
    o = torch.bmm(p.to(v.dtype).view(N, R, CHUNK), v.reshape(N, CHUNK, Dv)).view(B, Hkv, n, R, Dv)
    if n > 1:  # blocks in position order, sequentially: a block past a row's keys adds an exact 0
        den, o = den.cumsum(2)[:, :, -1], o.cumsum(2, dtype=torch.float32)[:, :, -1]
    else:
        den, o = den[:, :, 0], o[:, :, 0]
    if sinks is not None:
        den = den + torch.exp(sink - m)[:, :, 0, :, 0]
    out = (o / den[..., None]).to(q.dtype)  # [B, Hkv, R, Dv] (computed in fp32)
    if R > M:  # contiguous: with one query head per key head the reshape below would keep the padded stride
        out = out[:, :, :M].contiguous()
    return out.reshape(B, Hq, T, Dv)
