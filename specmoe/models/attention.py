"""Attention kernels besides the plain scaled-dot-product one that `decoder.Attention` uses.

`sink_attention` (GPT-OSS): every head has a learned logit, its *sink*, that joins each query's softmax
as an extra key with a zero value: it takes a share of the probability mass and returns nothing, so a
query may attend to little. Computed explicitly (SDPA has no sink input), in the query dtype with the
softmax's max subtracted first, as transformers does.
"""
from __future__ import annotations

import torch

# B=batch, Hq/Hkv=query/key heads, G=Hq/Hkv, T=queries, S=keys, Dh=head dim


def sink_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, sinks: torch.Tensor,
                   scale: float) -> torch.Tensor:
    """q [B, Hq, T, Dh], k and v [B, Hkv, S, Dh], mask [B, 1, T, S] bool (True = visible) or None, sinks [Hq]
    → [B, Hq, T, Dh]."""
    B, Hq, T, Dh = q.shape
    Hkv, S = k.shape[1], k.shape[2]
    qg = q.view(B, Hkv, Hq // Hkv, T, Dh)  # [B, Hkv, G, T, Dh]: the heads sharing a key head
    logits = torch.matmul(qg, k[:, :, None].transpose(-1, -2)).view(B, Hq, T, S) * scale
    if mask is not None:  # None: every key visible
        logits = logits.masked_fill(~mask, float("-inf"))
    logits = torch.cat((logits, sinks.to(logits.dtype).view(1, Hq, 1, 1).expand(B, Hq, T, 1)), dim=-1)
    logits = logits - logits.max(dim=-1, keepdim=True).values
    probs = torch.softmax(logits, dim=-1)[..., :S]  # the sink's share is dropped
    out = torch.matmul(probs.to(v.dtype).view(B, Hkv, Hq // Hkv, T, S), v[:, :, None])  # [B, Hkv, G, T, Dh]
    return out.view(B, Hq, T, Dh)
