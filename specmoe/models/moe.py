"""The sparse MoE block: router → (optional routing hook) → routed experts computed over the expert
store's slot tensors → (+ Qwen2-MoE shared expert).

Expert weights are not module parameters. An expert store exposes each MoE layer's slots as typed
tensors (gate_up [S, 2I, D], down [S, D, I]) and hands a forward `SlotGroup`s: the slot tensors plus a
device map expert → slot. One grouped operation (`routed_experts`) computes every routed assignment
of any number of tokens over those slots: assignments sorted by slot, one grouped matmul per projection
(`F.grouped_mm`, no copy of the weights, no host read). Target forwards, the draft and prefill all use
it; the draft passes its pinned slots directly (`ForwardContext.draft_slots`), so it reads the store's
slots in place. A decoding strategy changes which experts a forward may use through
`ForwardContext.routing_hook` (SpecMoE's draft restricts routing to the pinned draft experts), never by
copying the model.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from specmoe.config import ModelConfig
from specmoe.models.layers import DenseMLP
from specmoe.models.routers import route

# N=tokens (B·T flattened), D=hidden, E=experts, K=top-k, I=expert hidden, S=slots of a group


@dataclass
class SlotGroup:
    """Experts ready to compute: expert e sits in row `slot_of[e]` of `gate_up` [S, 2I, D] / `down` [S, D, I]
    (typed views of a store's slots, any batch stride); `slot_of` [E + 1] long on the device holds S for
    experts outside this group and for E (no expert: padding). `complete`: the group holds every expert of
    the request (no other group follows)."""
    gate_up: torch.Tensor
    down: torch.Tensor
    slot_of: torch.Tensor
    complete: bool = True
    # the grouped matmul's operands: gate_up / down transposed ([S, D, 2I], [S, I, D]); views, made once per group
    w_in: torch.Tensor = field(init=False, repr=False)
    w_out: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self):
        self.w_in, self.w_out = self.gate_up.transpose(1, 2), self.down.transpose(1, 2)


class Routing:
    """One MoE layer's routed assignments in one forward: ids [N, K] (E at padding tokens when `padded`), weights
    [N, K] fp32. `counts` [E] stays
    on the device; `counts_host` / `needed` (sorted used expert ids) are read to the host at most once, and
    only by whoever needs them (an offloading cache must know the union to fetch it; a resident store
    never reads it)."""

    def __init__(self, ids: torch.Tensor, weights: torch.Tensor, num_experts: int, padded: bool = False):
        self.ids, self.weights, self.num_experts = ids, weights, num_experts
        self.padded = padded  # some ids are E (padding tokens: no expert)
        self._counts: torch.Tensor | None = None
        self._host: list[int] | None = None

    @property
    def counts(self) -> torch.Tensor:
        if self._counts is None:
            flat = self.ids.reshape(-1)
            self._counts = (torch.bincount(flat, minlength=self.num_experts + 1)[: self.num_experts] if self.padded
                            else torch.bincount(flat, minlength=self.num_experts))
        return self._counts

    @property
    def counts_host(self) -> list[int]:
        if self._host is None:
            self._host = self.counts.tolist()  # the one host read of this layer's routing
        return self._host

    @property
    def needed(self) -> list[int]:
        return [e for e, c in enumerate(self.counts_host) if c]


class ExpertProvider(Protocol):
    """Contract (implemented by `experts.store.ExpertStore`): `fetch(layer, routing)` yields `SlotGroup`s that
    together hold every expert routing.needed names, each exactly once, each valid until the next group
    is asked for."""

    def fetch(self, layer: int, routing: Routing) -> Iterator[SlotGroup]:
        ...


# (layer, router logits [N, E], weights [N, K] fp32, ids [N, K]) -> (weights, ids)
RoutingHook = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class ForwardContext:
    """What one forward may use: where experts come from, an optional routing hook,
    and observers called per MoE layer of target forwards with (layer, Routing): they read the counts on the
    device, or on the host (`counts_host`, one read per layer shared by every reader)."""
    provider: ExpertProvider
    routing_hook: RoutingHook | None = None
    observers: list = field(default_factory=list)
    # called at the start of each MoE layer with (layer, hidden [N, D]); used for prefetch
    layer_hooks: list = field(default_factory=list)
    # [B·T, 1] True at the padding tokens of a ragged forward, None when all are real; set by Transformer.forward
    padding: torch.Tensor | None = None
    # layer -> the resident slots this forward computes from (SpecMoE's draft: its pinned draft experts, read
    # in place); the provider and the observers are not asked, and no host read happens
    draft_slots: dict[int, SlotGroup] | None = None
    # seconds spent in the routed experts of this forward (fetch wait included), for the step breakdown
    expert_s: float = 0.0


def glu(h: torch.Tensor) -> torch.Tensor:
    """SwiGLU's gate: h [.., 2I] = [gate; up] → silu(gate)·up [.., I]."""
    g, u = h.chunk(2, dim=-1)
    return F.silu(g) * u


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
           offs: torch.Tensor | None = None) -> torch.Tensor:
    """The expert math, in one place. One expert: x [n, D], gate_up [2I, D], down [D, I] → [n, D]. Grouped:
    `gate_up` / `down` are a group's transposed slots (SlotGroup.w_in [S, D, 2I], .w_out [S, I, D]) and
    `offs` [S] int32 the end row of each slot's tokens in x (rows past offs[-1] are left unwritten) → x's
    rows each through its slot's expert, one grouped matmul per projection."""
    if offs is None:
        return F.linear(glu(F.linear(x, gate_up)), down)
    if not grouped_mm_works(x.device, x.dtype):
        return _looped(x, gate_up, down, offs)
    return F.grouped_mm(glu(F.grouped_mm(x, gate_up, offs=offs)), down, offs=offs)  # [n, D]


def _looped(x, w_in, w_out, offs):
    """swiglu's grouped form where F.grouped_mm does not run (device/dtype): a loop over the used slots (one
    host read of the offsets)."""
    out = torch.zeros(x.shape[0], w_out.shape[2], dtype=x.dtype, device=x.device)
    start = 0
    for s, end in enumerate(offs.tolist()):
        if end > start:
            out[start:end] = swiglu(x[start:end], w_in[s].t(), w_out[s].t())
        start = end
    return out


_GROUPED_MM: dict = {}


def grouped_mm_works(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether F.grouped_mm runs for this device and dtype (tried once on a tiny problem, remembered)."""
    key = (device.type, dtype)
    if key not in _GROUPED_MM:
        try:
            a = torch.ones(2, 8, dtype=dtype, device=device)
            b = torch.ones(2, 8, 8, dtype=dtype, device=device)
            F.grouped_mm(a, b, offs=torch.tensor([1, 2], dtype=torch.int32, device=device))
            _GROUPED_MM[key] = True
        except (RuntimeError, NotImplementedError):
            _GROUPED_MM[key] = False
    return _GROUPED_MM[key]


def routed_experts(x: torch.Tensor, routing: Routing, groups: Iterable[SlotGroup]) -> torch.Tensor:
    """Routed-expert output [N, D] for x [N, D]: per group, its assignments sorted by slot (stable: each slot's
    tokens in token order) go through `swiglu`'s grouped form; each assignment's result lands in its own row,
    and the K results of a token are summed in routing order, so the output does not depend on which slot
    holds an expert or how the store split the experts into groups (offloaded == resident, bit for bit)."""
    N, K = routing.ids.shape
    flat = routing.ids.reshape(-1)  # [N·K]
    y = None  # [N·K, D] per assignment, in routing order
    for g in groups:
        S = g.gate_up.shape[0]
        slot = g.slot_of[flat]  # [N·K]; S for experts of other groups and for padding
        order = torch.argsort(slot, stable=True)
        per_slot = (torch.bincount(slot, minlength=S + 1)[:S] if routing.padded or not g.complete
                    else torch.bincount(slot, minlength=S))
        ys = swiglu(x[order // K], g.w_in, g.w_out, per_slot.cumsum(0, dtype=torch.int32))  # [N·K, D] sorted
        if y is None:
            y = torch.empty_like(ys)
        if not g.complete:  # keep the rows other groups computed
            ys = torch.where((slot[order] < S)[:, None], ys, y[order])
        y.index_copy_(0, order, ys)
    if y is None:  # nothing routed (every token is padding)
        return torch.zeros_like(x)
    y = y.view(N, K, -1)
    if routing.padded:  # rows past the grouped op's last offset are not written: zero them
        y = y.masked_fill((routing.ids == routing.num_experts)[..., None], 0)
    w = routing.weights if routing.weights.dtype == x.dtype else routing.weights.to(x.dtype)
    return (y * w[..., None]).sum(1)


class MoEBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        if cfg.shared_expert_intermediate_size:
            self.shared = DenseMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
            self.shared_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def route(self, x: torch.Tensor):
        """x [N, D] → logits [N, E], weights [N, K] fp32, ids [N, K]."""
        logits = self.router(x)
        weights, ids = route(self.cfg.model_type, logits, top_k=self.cfg.top_k,
                             norm_topk_prob=self.cfg.norm_topk_prob)
        return logits, weights, ids

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """x [N, D] (the forward's tokens, flattened) → [N, D]."""
        for hook in ctx.layer_hooks:
            hook(self.layer, x)
        logits, weights, ids = self.route(x)
        if ctx.routing_hook is not None:
            weights, ids = ctx.routing_hook(self.layer, logits, weights, ids)
        if ctx.padding is not None:  # padding routes to no expert (id E): not counted, fetches nothing, output 0
            ids = ids.masked_fill(ctx.padding, self.cfg.num_experts)
        t0 = time.perf_counter()
        out = self.experts_forward(x, weights, ids, ctx)
        ctx.expert_s += time.perf_counter() - t0
        if self.cfg.shared_expert_intermediate_size:
            out = out + torch.sigmoid(self.shared_gate(x)) * self.shared(x)
        return out

    def experts_forward(self, x, weights, ids, ctx: ForwardContext) -> torch.Tensor:
        routing = Routing(ids, weights, self.cfg.num_experts, padded=ctx.padding is not None)
        if ctx.draft_slots is not None:
            return routed_experts(x, routing, (ctx.draft_slots[self.layer],))
        for obs in ctx.observers:
            obs(self.layer, routing)
        return routed_experts(x, routing, ctx.provider.fetch(self.layer, routing))
