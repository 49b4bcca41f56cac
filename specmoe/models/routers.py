"""Routers as pure functions: router logits → (top-k weights, top-k expert ids).

Each family's rule, as transformers implements it (checked in tests/models/test_routers.py):
- Mixtral: softmax over all experts (fp32) → top-k → renormalise (computed as the softmax of the top-k logits).
- Qwen2-MoE / Qwen3-MoE / OLMoE: softmax (fp32) → top-k → renormalise iff `norm_topk_prob`.
- GLM-4 MoE / DeepSeek-V3: sigmoid scores (fp32); the choice adds `e_score_correction_bias` and is limited
  to the `topk_group` best of `n_group` expert groups (a group scores the sum of its two best); the
  weights are the chosen experts' plain sigmoid scores, renormalised iff `norm_topk_prob`, times
  `routed_scaling_factor`.
- DeepSeek-V2: softmax (fp32), limited to the `topk_group` best of `n_group` groups (a group scores its
  best expert; the others' scores set to 0) → top-k, not renormalised, times `routed_scaling_factor`.
- GPT-OSS: top-k of the logits → softmax over those k.
- Llama-4: top-k of the logits → the sigmoid of each (not renormalised); the MoE block scales the expert's
  input by it, not its output (`ModelConfig.routed_input_scaled`).
- MiniMax-M2: GLM-4's sigmoid router with one group, always renormalised, no scaling factor.
- NLLB-MoE (`top2_capacity`): softmax (fp32, cast to the input dtype); the first expert is the argmax of those
  probabilities, the second the argmax of the logits without it; their two probabilities normalised to sum 1, times
  `routed_scaling_factor` (1 - moe_token_dropout). In the encoder a capacity rule (`config.Capacity`) may drop
  assignments: a dropped one keeps its expert id with weight 0 (an exact zero contribution).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specmoe.config import Capacity
from specmoe.families import family_of
from specmoe.models.layers import sigmoid

# N=tokens, E=experts, K=top-k, G=groups


def softmax_topk(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Renormalised: the softmax over the top-k logits (the same weights as renormalising the top-k of the full
    softmax, in two ops); else the top-k of the full softmax."""
    logits = logits if logits.dtype == torch.float32 else logits.float()
    if normalize:
        values, ids = torch.topk(logits, top_k, dim=-1)  # [N, K]
        return torch.softmax(values, dim=-1), ids
    probs = torch.softmax(logits, dim=-1)  # [N, E]
    return torch.topk(probs, top_k, dim=-1)  # [N, K]


def sigmoid_group_topk(logits: torch.Tensor, top_k: int, *, correction_bias: torch.Tensor, n_group: int,
                       topk_group: int, normalize: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    scores = sigmoid(logits.float())  # [N, E] (placed so that a row's bits do not depend on its place)
    choice = scores + correction_bias.float()  # picks use the bias, weights do not
    N, E = choice.shape
    if topk_group < n_group:  # keep the experts of the topk_group best groups
        group_scores = choice.view(N, n_group, E // n_group).topk(2, dim=-1)[0].sum(dim=-1)  # [N, G]
        best = torch.topk(group_scores, topk_group, dim=-1, sorted=False)[1]  # [N, topk_group]
        keep = torch.zeros(N, n_group, dtype=torch.bool, device=logits.device).scatter_(1, best, True)
        choice = choice.masked_fill(~keep.repeat_interleave(E // n_group, dim=1), float("-inf"))
    ids = torch.topk(choice, top_k, dim=-1, sorted=False)[1]  # [N, K]
    weights = scores.gather(1, ids)
    if normalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * scale, ids


def softmax_group_topk(logits: torch.Tensor, top_k: int, *, n_group: int, topk_group: int,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    scores = torch.softmax(logits.float(), dim=-1)  # [N, E]
    N, E = scores.shape
    if topk_group < n_group:
        best = torch.topk(scores.view(N, n_group, E // n_group).amax(dim=-1), topk_group, dim=-1, sorted=False)[1]
        keep = torch.zeros(N, n_group, dtype=torch.bool, device=logits.device).scatter_(1, best, True)
        scores = scores.masked_fill(~keep.repeat_interleave(E // n_group, dim=1), 0.0)
    weights, ids = torch.topk(scores, top_k, dim=-1, sorted=False)
    return weights * scale, ids


def topk_softmax(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, ids = torch.topk(logits, top_k, dim=-1)  # [N, K]
    return torch.softmax(values.float(), dim=-1), ids


def topk_sigmoid(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    values, ids = torch.topk(logits, top_k, dim=-1)  # [N, K]
    return sigmoid(values.float()), ids
def _locations(mask: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """[N, E] 0/1 → each set entry's rank among its expert's set entries (in `order` when given: transformers'
    batch-prioritised routing), 0 elsewhere (transformers' (cumsum - 1) · mask)."""
    if order is None:
        return torch.cumsum(mask, dim=0) - 1
    m = mask[order]
    return ((torch.cumsum(m, dim=0) - 1) * m)[order.argsort(dim=0)]


def top2_capacity(logits: torch.Tensor, input_dtype: torch.dtype, capacity: Capacity | None,
                  scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """NLLB-MoE's top-2 router as transformers' `NllbMoeTop2Router.route_tokens` in eval (second_expert_policy
    "all"), logits [N, E] fp32 → weights [N, 2] fp32, ids [N, 2]. `capacity` None: no capacity rule (no assignment
    is dropped); else over these N tokens (see `config.Capacity`; each token's output then depends on the others)."""
    N, E = logits.shape
    probs = torch.softmax(logits.float(), dim=-1).to(input_dtype)
    top1 = probs.argmax(dim=-1)
    mask1 = F.one_hot(top1, E)
    top2 = logits.masked_fill(mask1.bool(), float("-inf")).argmax(dim=-1)
    p1, p2 = probs.gather(1, top1[:, None])[:, 0], probs.gather(1, top2[:, None])[:, 0]

    def normalized(a, b):
        d = (a + b).clamp(min=torch.finfo(probs.dtype).eps)
        return a / d, b / d
    if capacity is None:
        w1, w2 = normalized(p1, p2)
    else:
        mask2 = F.one_hot(top2, E)
        order = (-probs.max(dim=1)[0]).argsort(dim=0) if capacity.batch_prioritized else None
        loc1 = _locations(mask1, order)
        loc2 = _locations(mask2, order) + mask1.sum(dim=0, keepdim=True)
        C = capacity.limit(N, E)
        keep1 = ((loc1 < C) & mask1.bool()).any(dim=1)
        keep2 = ((loc2 < C) & mask2.bool()).any(dim=1)
        if capacity.normalize_before_dropping:
            w1, w2 = normalized(p1, p2)
            w1, w2 = w1 * keep1, w2 * keep2
        else:
            w1, w2 = normalized(p1 * keep1, p2 * keep2)
    weights = torch.stack((w1, w2), dim=1).float()
    return (weights * scale if scale != 1.0 else weights), torch.stack((top1, top2), dim=1)


def route(model_type: str, logits: torch.Tensor, *, top_k: int, norm_topk_prob: bool,
          correction_bias: torch.Tensor | None = None, n_group: int = 1, topk_group: int = 1,
          scale: float = 1.0, input_dtype: torch.dtype = torch.float32, capacity: Capacity | None = None):
    """The router the family declares (`Family.router_kind`, in its module under specmoe/families/). Returns fp32
    weights [N, K] and int64 ids [N, K]."""
    kind = family_of(model_type).router_kind
    if kind == "top2-capacity":
        return top2_capacity(logits, input_dtype, capacity, scale)
    if kind == "softmax-topk":
        return softmax_topk(logits, top_k, norm_topk_prob)
    if kind == "sigmoid-group-topk":
        return sigmoid_group_topk(logits, top_k, correction_bias=correction_bias, n_group=n_group,
                                  topk_group=topk_group, normalize=norm_topk_prob, scale=scale)
    if kind == "softmax-group-topk":
        return softmax_group_topk(logits, top_k, n_group=n_group, topk_group=topk_group, scale=scale)
    if kind == "topk-softmax":
        return topk_softmax(logits, top_k)
    if kind == "topk-sigmoid":
        return topk_sigmoid(logits, top_k)
    raise ValueError(f"no router {kind!r} (family {model_type})")
