"""The sparse MoE block: router → (optional routing hook) → experts fetched by
(layer, expert) from an ExpertProvider → weighted scatter-add (+ shared expert: Qwen2-MoE's
sigmoid-gated one, or GLM-4's / DeepSeek's plain one).

The block never knows which tier an expert's bytes come from. A decoding strategy
changes which experts a forward may use through `ForwardContext.routing_hook`
(SpecMoE's draft restricts routing to the resident draft experts), never by copying
the model. Each forward asks the provider once per layer for the *union* of the
experts its tokens need, whatever the batch size.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from specmoe.config import ModelConfig
from specmoe.models.layers import DenseMLP
from specmoe.models.routers import route

# N=tokens (B·T flattened), D=hidden, E=experts, K=top-k, I=expert hidden


class ExpertProvider(Protocol):
    """Contract: `fetch(layer, ids)` yields `(expert_id, buffer)` exactly once for every id
    in `ids` (a sorted list of distinct ids), in any order (resident ones first is
    best), where `buffer` is the expert packed flat as [gate (I·D); up (I·D); down (D·I)]
    (+ [gate bias (I); up bias (I); down bias (D)] with `cfg.expert_bias`) on the compute device, valid until the next item is asked for (an offloading cache reuses
    its few scratch rows); a consumer that keeps a buffer longer clones it."""

    def fetch(self, layer: int, ids: list[int]):
        ...


# (layer, router logits [N, E], weights [N, K] fp32, ids [N, K]) -> (weights, ids)
RoutingHook = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
# (layer, x [N, D], weights [N, K] fp32, ids [N, K]) -> routed-expert output [N, D]
ExpertsOverride = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class ForwardContext:
    """What one forward may use: where experts come from, an optional routing hook,
    and observers called per MoE layer with (layer, ids [N, K], counts [E] list[int])."""
    provider: ExpertProvider
    routing_hook: RoutingHook | None = None
    observers: list = field(default_factory=list)
    # called at the start of each MoE layer with (layer, hidden [N, D]); used for prefetch
    layer_hooks: list = field(default_factory=list)
    # flat indices of real (non-padding) tokens of the current forward, None when all are real;
    # set by Transformer.forward
    token_index: torch.Tensor | None = None
    # optional replacement of the routed-expert computation (provider, observers and the per-layer
    # host sync are skipped). SpecMoE's draft computes its few resident draft experts as one grouped
    # op with it; None keeps the regular path.
    experts_override: ExpertsOverride | None = None
    # seconds spent in the routed experts of this forward (fetch wait included), for the step breakdown
    expert_s: float = 0.0


def glu(g: torch.Tensor, u: torch.Tensor, limit: float | None = None, alpha: float = 1.702) -> torch.Tensor:
    """silu(g)·u, or with `limit` GPT-OSS's clamped form: (clamp(u, ±limit) + 1) · g'·σ(α·g'),
    g' = min(g, limit)."""
    if limit is None:
        return F.silu(g) * u
    g = g.clamp(max=limit)
    return (u.clamp(-limit, limit) + 1) * (g * torch.sigmoid(g * alpha))


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, gate_up_bias: torch.Tensor | None = None,
           down_bias: torch.Tensor | None = None, limit: float | None = None, alpha: float = 1.702) -> torch.Tensor:
    """SwiGLU expert: x [n, D], gate_up [2I, D], down [D, I] (views, any row stride), optional biases [2I] and
    [D], the activation `glu` → [n, D]."""
    g, u = F.linear(x, gate_up, gate_up_bias).chunk(2, dim=-1)  # [n, I] each
    return F.linear(glu(g, u, limit, alpha), down, down_bias)


def expert_views(buf: torch.Tensor, cfg: ModelConfig):
    """(gate_up [2I, D], down [D, I], gate_up bias [2I] or None, down bias [D] or None) of a packed expert."""
    D, I = cfg.hidden_size, cfg.expert_intermediate_size
    w = 3 * I * D
    gate_up, down = buf[: 2 * I * D].view(2 * I, D), buf[2 * I * D: w].view(D, I)
    if not cfg.expert_bias:
        return gate_up, down, None, None
    return gate_up, down, buf[w: w + 2 * I], buf[w + 2 * I: w + 2 * I + D]


def expert_ffn(x: torch.Tensor, buf: torch.Tensor, cfg: ModelConfig) -> torch.Tensor:
    """The family's SwiGLU expert on a packed buffer. x [n, D] → [n, D]."""
    return swiglu(x, *expert_views(buf, cfg), limit=cfg.swiglu_limit, alpha=cfg.swiglu_alpha)


def grouped_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, num_experts: int, run,
                    on_counts=None) -> torch.Tensor:
    """Routed-expert output [N, D] for x [N, D], weights [N, K], ids [N, K]: assignments sorted by expert,
    each used expert computed once over its tokens, the weighted results scattered back.

    `run(needed, xs)` yields `(index into needed, y)` for each used expert id in `needed` (ascending) with its
    tokens xs[i] [n_e, D], in any order (results land in fixed places, so the sum is bitwise independent of
    the order); `on_counts(counts)` sees the per-expert assignment counts first (one host read per call)."""
    N, K = ids.shape
    flat = ids.reshape(-1)  # [N·K]
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    if on_counts is not None:
        on_counts(counts)
    token_of = order // K  # [N·K] token of each sorted assignment
    needed = [e for e in range(num_experts) if counts[e]]
    xs = x[token_of].split([counts[e] for e in needed])  # per used expert: its tokens (views)
    ys: list = [None] * len(needed)
    for i, y in run(needed, xs):
        ys[i] = y
    ws = weights.reshape(-1)[order].to(x.dtype)[:, None]  # [N·K, 1] in sorted order
    y = ys[0] if len(ys) == 1 else torch.cat(ys)
    return torch.zeros_like(x).index_add_(0, token_of, y * ws)


class MoEBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=cfg.router_bias)
        if cfg.score_correction_bias:
            self.correction_bias = nn.Parameter(torch.zeros(cfg.num_experts))
        if cfg.shared_expert_intermediate_size:
            self.shared = DenseMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
            if cfg.shared_expert_gate:
                self.shared_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def route(self, x: torch.Tensor):
        """x [N, D] → logits [N, E], weights [N, K] fp32, ids [N, K]."""
        cfg, w = self.cfg, self.router.weight
        logits = F.linear(x.to(w.dtype), w, self.router.bias)  # the sigmoid routers keep fp32 weights
        weights, ids = route(cfg.model_type, logits, top_k=cfg.top_k, norm_topk_prob=cfg.norm_topk_prob,
                             correction_bias=self.correction_bias if cfg.score_correction_bias else None,
                             n_group=cfg.n_group, topk_group=cfg.topk_group, scale=cfg.routed_scaling_factor)
        return logits, weights, ids

    def forward(self, h: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        shape = h.shape
        x = h.reshape(-1, shape[-1])  # [N, D]
        if ctx.token_index is not None:  # padding is neither routed nor counted, and fetches nothing
            out = torch.zeros_like(x)
            out[ctx.token_index] = self._forward_tokens(x[ctx.token_index], ctx)
            return out.view(shape)
        return self._forward_tokens(x, ctx).view(shape)

    def _forward_tokens(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        for hook in ctx.layer_hooks:
            hook(self.layer, x)
        logits, weights, ids = self.route(x)
        if ctx.routing_hook is not None:
            weights, ids = ctx.routing_hook(self.layer, logits, weights, ids)
        t0 = time.perf_counter()
        if ctx.experts_override is not None:
            out = ctx.experts_override(self.layer, x, weights, ids)
        else:
            out = self.experts_forward(x, weights, ids, ctx)
        ctx.expert_s += time.perf_counter() - t0
        if self.cfg.shared_expert_intermediate_size:
            shared = self.shared(x)
            out = out + (torch.sigmoid(self.shared_gate(x)) * shared if self.cfg.shared_expert_gate else shared)
        return out

    def experts_forward(self, x, weights, ids, ctx: ForwardContext) -> torch.Tensor:
        def observe(counts):  # the one host read per layer: the union must be known to fetch it
            for obs in ctx.observers:
                obs(self.layer, ids, counts)

        def run(needed, xs):  # the provider hands experts out in its own order (resident first)
            slot = {e: i for i, e in enumerate(needed)}
            for e, buf in ctx.provider.fetch(self.layer, needed):
                yield slot[e], expert_ffn(xs[slot[e]], buf, self.cfg)
        return grouped_experts(x, weights, ids, self.cfg.num_experts, run, observe)
