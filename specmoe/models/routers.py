"""Routers as pure functions: router logits → (top-k weights, top-k expert ids).

Each family's rule, as transformers implements it (checked in tests/models/test_routers.py):
- Mixtral: softmax over all experts (fp32) → top-k → renormalise.
- Qwen2-MoE / Qwen3-MoE / OLMoE: softmax (fp32) → top-k → renormalise iff `norm_topk_prob`.
"""
from __future__ import annotations

import torch

# N=tokens, E=experts, K=top-k


def softmax_topk(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    probs = torch.softmax(logits.float(), dim=-1)  # [N, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [N, K]
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def route(model_type: str, logits: torch.Tensor, *, top_k: int, norm_topk_prob: bool):
    """Dispatch on family. Returns fp32 weights [N, K] and int64 ids [N, K]."""
    if model_type == "mixtral":
        return softmax_topk(logits, top_k, True)
    if model_type in ("qwen2_moe", "qwen3_moe", "olmoe"):
        return softmax_topk(logits, top_k, norm_topk_prob)
    raise ValueError(f"no router for {model_type}")
