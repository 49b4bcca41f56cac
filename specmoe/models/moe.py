"""The sparse MoE block: router → (optional routing hook) → routed experts computed over the expert
store's slot tensors → (+ shared expert: Qwen2-MoE's sigmoid-gated one, or GLM-4's / DeepSeek's plain one).

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

from specmoe import kernels as native
from specmoe.config import ModelConfig
from specmoe.models.layers import DenseMLP, linear, min_rows, native_rows_alike, sigmoid, silu
from specmoe.models.orientation import use_weight_major
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
    # assignments of the request that fall on this group (a host count the store knows), None: every real one
    rows: int | None = None
    # families with expert biases (GPT-OSS): gate_up bias [S, 2I], down bias [S, D]; None otherwise
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    identity: bool = False  # slot_of[e] == e for every expert and S == E (a resident store): no lookup needed
    # slots holding a quantized format's stored bytes (native kernels only): gate_up / down int8 [S, G, D] / [S, D, I]
    # with one fp32 scale per row ([S, G] / [S, D]), or int4 nibbles [S, G, D/2] / [S, D, I/2] with fp16 scales per
    # `group` weights ([S, G, D/group] / [S, D, I/group]); None: float slots
    gate_up_scale: torch.Tensor | None = None
    down_scale: torch.Tensor | None = None
    group: int = 32
    # the grouped matmul's operands: gate_up / down transposed ([S, D, 2I], [S, I, D]); views, made once per group
    w_in: torch.Tensor = field(init=False, repr=False)
    w_out: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self):
        self.w_in, self.w_out = self.gate_up.transpose(1, 2), self.down.transpose(1, 2)
        # F.grouped_mm wants 16-byte strides: decided by the shapes and the stores' (aligned) row strides only,
        # so a resident store and a cache take the same form (offloaded == resident, bit for bit)
        es = self.gate_up.element_size()
        self.grouped = all(st * es % 16 == 0 for t in (self.w_in, self.w_out) for st in t.stride() if st != 1) \
            and all(n * es % 16 == 0 for n in self.gate_up.shape[1:])

    @staticmethod
    def over(slots: tuple, slot_of: torch.Tensor, complete: bool = True, rows: int | None = None,
             identity: bool = False) -> "SlotGroup":
        """A group over a store's `slot_tensors` (gate_up, down, gate_up bias or None, down bias or None[, gate_up
        scale, down scale, group]: stored quantized slots)."""
        gate_up, down, gate_up_bias, down_bias, *q = slots
        return SlotGroup(gate_up, down, slot_of, complete, rows, gate_up_bias, down_bias, identity, *q)


class Routing:
    """One MoE layer's routed assignments in one forward: ids [N, K] (E at padding tokens when `padded`), weights
    [N, K] fp32. `counts` [E] stays
    on the device; `counts_host` / `needed` (sorted used expert ids) are read to the host at most once, and
    only by whoever needs them (an offloading cache must know the union to fetch it; a resident store
    never reads it)."""

    def __init__(self, ids: torch.Tensor, weights: torch.Tensor, num_experts: int, padded: bool = False,
                 real_tokens: int | None = None):
        self.ids, self.weights, self.num_experts = ids, weights, num_experts
        self.padded = padded  # some ids are E (padding tokens: no expert)
        self.real_tokens = ids.shape[0] if real_tokens is None else real_tokens  # tokens that are not padding
        self._counts: torch.Tensor | None = None
        self._host: list[int] | None = None

    def weights_col(self, dtype: torch.dtype) -> torch.Tensor:
        """weights as [N, K, 1] in `dtype` (to scale each assignment's output row)."""
        w = self.weights if self.weights.dtype == dtype else self.weights.to(dtype)
        return w.unsqueeze(-1)

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
    real_tokens: int | None = None  # how many tokens are not padding (host int), None: all
    # layer -> the resident slots this forward computes from (SpecMoE's draft: its pinned draft experts, read
    # in place); the provider and the observers are not asked, and no host read happens
    draft_slots: dict[int, SlotGroup] | None = None
    # seconds spent in the routed experts of this forward (fetch wait included), for the step breakdown
    expert_s: float = 0.0
    # layer indices whose input hidden state [B, T, D] the forward keeps in `hidden` (index num_layers: the final
    # normed state, what the LM head reads); EAGLE drafters read the target's features from there
    capture_hidden: tuple[int, ...] = ()
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)


def glu(g: torch.Tensor, u: torch.Tensor, limit: float | None = None, alpha: float = 1.702) -> torch.Tensor:
    """silu(g)·u, or with `limit` GPT-OSS's clamped form: (clamp(u, ±limit) + 1) · g'·σ(α·g'),
    g' = min(g, limit)."""
    if limit is None:
        return silu(g) * u
    g = g.clamp(max=limit)
    return (u.clamp(-limit, limit) + 1) * (g * sigmoid(g * alpha))


@dataclass(frozen=True)
class ExpertMath:
    """The family's expert math: SwiGLU, GPT-OSS's clamped variant (`limit`, `alpha`), or (`act` "relu", NLLB-MoE)
    ReLU of the one input projection (gate_up holds fc1 alone); where a routing weight applies: to the expert's
    output, or (`scale_input`, Llama-4) to its input."""
    limit: float | None = None
    alpha: float = 1.702
    act: str = "swiglu"
    scale_input: bool = False

    @staticmethod
    def of(cfg: ModelConfig) -> "ExpertMath":
        return ExpertMath(cfg.swiglu_limit, cfg.swiglu_alpha, cfg.expert_act, cfg.routed_input_scaled)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        """The input projection's output [n, 2I] (relu: [n, I]) → the activation [n, I]."""
        if self.act == "relu":
            return F.relu(h)
        g, u = h.chunk(2, dim=-1)
        return glu(g, u, self.limit, self.alpha)


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, gate_up_bias: torch.Tensor | None = None,
           down_bias: torch.Tensor | None = None, math: ExpertMath = ExpertMath()) -> torch.Tensor:
    """The expert math, in one place (one expert): x [n, D], gate_up [2I, D], down [D, I] (views, any row
    stride), optional biases [2I] and [D], the activation `glu` → [n, D]."""
    return F.linear(math(F.linear(x, gate_up, gate_up_bias)), down, down_bias)


def swiglu_grouped(x: torch.Tensor, g: SlotGroup, offs: torch.Tensor, slot: torch.Tensor | None,
                   math: ExpertMath, n: int | None = None, live: torch.Tensor | None = None,
                   weight_major: bool = False) -> torch.Tensor:
    """`swiglu` (the family's expert math) over a group's slots: x [n, D] rows sorted by slot, `offs` [S] int32 the end row of each slot's
    rows (rows past offs[-1] are left unwritten; with `n`, the rows from n on are zeroed before the activation),
    `slot` [n] the slot of each row (for the biases) → [n, D], one grouped matmul per projection. `live`: n as a
    device scalar (rows from it on zeroed likewise, without a host read). `weight_major`: computed so where this CPU
    is faster so (`orientation`; not in a deterministic model, whose rows are padded to `F.linear`'s row classes)."""
    if not (g.grouped and grouped_mm_works(x.device, x.dtype)):
        return _looped(x, g, offs, math)
    if weight_major and use_weight_major(x, g.gate_up.shape[1] * g.gate_up.shape[2]):
        return _weight_major(x, g, offs, slot, math, n, live)
    h = F.grouped_mm(x, g.w_in, offs=offs)  # [n, 2I]
    if n is not None and n < h.shape[0]:
        h[n:] = 0  # rows past offs[-1] are left unwritten: no activation over garbage (denormals crawl)
    elif live is not None:
        h.masked_fill_(_arange(h.shape[0], h.device)[:, None] >= live, 0)
    if g.gate_up_bias is not None:
        h = h + g.gate_up_bias[slot.clamp(max=g.gate_up_bias.shape[0] - 1)]
    y = F.grouped_mm(math(h), g.w_out, offs=offs)  # [n, D]
    if g.down_bias is not None:
        y = y + g.down_bias[slot.clamp(max=g.down_bias.shape[0] - 1)]
    return y


def _weight_major(x: torch.Tensor, g: SlotGroup, offs: torch.Tensor, slot: torch.Tensor | None, math: ExpertMath,
                  n: int | None, live: torch.Tensor | None) -> torch.Tensor:
    """`swiglu_grouped` weight-major (`orientation`): each slot's weights times its rows' transpose, (W @ xᵀ)ᵀ. The
    rows are padded to a multiple of 16 bytes (the grouped product's strides), the padding outside every slot."""
    rows = x.shape[0]
    al = 16 // x.element_size()
    P = -(-rows // al) * al
    xp = F.pad(x, (0, 0, 0, P - rows)) if P > rows else x
    h = F.grouped_mm(g.gate_up, xp.t(), offs=offs).t()  # [P, 2I] (memory [2I, P])
    m = rows if n is None else n
    if m < P:
        h[m:] = 0  # rows past offs[-1] are left unwritten
    if live is not None:
        h.masked_fill_(_arange(P, h.device)[:, None] >= live, 0)
    if g.gate_up_bias is not None:
        h[:rows] += g.gate_up_bias[slot.clamp(max=g.gate_up_bias.shape[0] - 1)]
    a = math(h).t()  # [I, P]
    y = F.grouped_mm(g.down, a if a.is_contiguous() else a.contiguous(), offs=offs).t()[:rows]  # [rows, D]
    if g.down_bias is not None:
        y = y + g.down_bias[slot.clamp(max=g.down_bias.shape[0] - 1)]
    return y


def _looped(x: torch.Tensor, g: SlotGroup, offs: torch.Tensor, math: ExpertMath) -> torch.Tensor:
    """swiglu_grouped where F.grouped_mm does not run (device/dtype): a loop over the used slots (one host read
    of the offsets)."""
    out = torch.zeros(x.shape[0], g.down.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for s, end in enumerate(offs.tolist()):
        if end > start:  # the rows copied to a fresh (aligned) buffer: CPU sgemm rounds a row by its input's
            # alignment, which depends on where the slot's rows start (so on the store's slot order)
            out[start:end] = swiglu(x[start:end].clone(), g.gate_up[s], g.down[s],
                                    None if g.gate_up_bias is None else g.gate_up_bias[s],
                                    None if g.down_bias is None else g.down_bias[s], math)
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


def routed_experts(x: torch.Tensor, routing: Routing, groups: Iterable[SlotGroup],
                   math: ExpertMath = ExpertMath(), rows: int = 1) -> torch.Tensor:
    """Routed-expert output [N, D] for x [N, D]: per group, its assignments sorted by slot (stable: each slot's
    tokens in token order) go through `swiglu`'s grouped form; each assignment's result lands in its own row,
    and the K results of a token are summed in routing order (each times its weight, or with `math.scale_input`
    each computed from the token times its weight), so the output does not depend on which slot
    holds an expert or how the store split the experts into groups (offloaded == resident, bit for bit).
    `rows` > 1 with fp32 (a deterministic model), or experts too small for oneDNN's threshold in bf16/fp16: each
    slot's rows are padded (see `padded_groups`, `layers.min_rows`), so a token's result does not depend on how many
    others share its expert."""
    if x.device.type == "cpu" and native.available():
        return native_experts(x, routing, groups, math, invariant=native_rows_alike(x, rows))
    N, K = routing.ids.shape
    flat = routing.ids.view(-1)  # [N·K]
    y = None  # [N·K, D] per assignment, in routing order
    for g in groups:
        if g.gate_up_scale is not None:
            raise RuntimeError("these expert slots hold quantized stored bytes, which only the native CPU kernels "
                               "compute from; the native path is off (build the LLM with it off to decode them on "
                               "arrival)")
        n = routing.real_tokens * K if g.rows is None else g.rows  # the group's assignments sort first
        if n == 0:
            continue
        S = g.gate_up.shape[0]
        slot, order = torch.sort(flat if g.identity else g.slot_of[flat], stable=True)  # [N·K] sorted slots (S: other groups, padding)
        # end row of each slot's rows: rows with a slot <= s
        offs = torch.searchsorted(slot, _arange(S, slot.device), right=True, out_int32=True)  # [S]
        # every group multiplies all N·K rows (the grouped matmul's blocking, hence its bits, depends on the row
        # count: the same for every store and group split), of which the first n are this group's
        rows_in = x.repeat(K, 1) if N == 1 else x[order // K]  # [N·K, D]: each sorted row's token
        if math.scale_input:  # Llama-4: the expert reads its token times the assignment's weight
            rows_in = rows_in * routing.weights.view(-1)[order].to(x.dtype)[:, None]
        R = min_rows(x.dtype, g.down.shape[1] * g.down.shape[2], rows)  # > 1: fp32 deterministic, or tiny experts
        if R > 1:
            ys = padded_groups(rows_in, g, slot, offs, math, R)
        else:
            ys = swiglu_grouped(rows_in, g, offs, slot if g.gate_up_bias is not None else None,
                                math, n, weight_major=N * K >= 2)  # [N·K, D] sorted by slot; rows from n on are not this group's
        if y is None and n == N * K and g.complete:  # the one group: its rows put back in routing order
            y = torch.index_copy(ys, 0, order, ys).view(N, K, -1)
            break
        if y is None:  # rows no group computes (padding) stay 0
            y = torch.zeros(N, K, ys.shape[1], dtype=ys.dtype, device=ys.device)
        if n < N * K:
            order, ys = order[:n], ys[:n]
        y.view(N * K, -1).index_copy_(0, order, ys)
    if y is None:  # nothing routed (every token is padding)
        return torch.zeros_like(x)
    return y.sum(1) if math.scale_input else (y * routing.weights_col(x.dtype)).sum(1)


def native_experts(x: torch.Tensor, routing: Routing, groups: Iterable[SlotGroup],
                   math: ExpertMath = ExpertMath(), invariant: bool = False) -> torch.Tensor:
    """`routed_experts` on the CPU's native kernels (specmoe.kernels): one call per slot group computes each of its
    assignments from the slots in their stored dtype (bf16 / fp16 / fp32, read once per call for all the rows that
    use an expert), with fp32 activations; then the K results of a token summed in routing order, each times its
    weight. A row's result does not depend on the other rows, the group split or which slot holds an expert (an expert
    of more than `native.BLAS_ROWS` rows takes BLAS unless `invariant`: a deterministic or half-precision model), so no
    padding is needed and offloaded == resident bit for bit."""
    N, K = routing.ids.shape
    flat = routing.ids.view(-1)
    y = torch.zeros(N * K, x.shape[1], dtype=torch.float32)
    scale = routing.weights.reshape(-1) if math.scale_input else None
    for g in groups:
        if (routing.real_tokens * K if g.rows is None else g.rows) == 0:
            continue
        native.moe(x, flat if g.identity else g.slot_of[flat], g.gate_up, g.down, y, k=K, act=math.act,
                   limit=math.limit, alpha=math.alpha, gate_up_bias=g.gate_up_bias, down_bias=g.down_bias,
                   gate_up_scale=g.gate_up_scale, down_scale=g.down_scale, group=g.group, row_scale=scale,
                   invariant=invariant)
    y = y.view(N, K, -1)
    out = y.sum(1) if math.scale_input else (y * routing.weights.unsqueeze(-1)).sum(1)
    return out if out.dtype == x.dtype else out.to(x.dtype)


def padded_groups(rows_in: torch.Tensor, g: SlotGroup, slot: torch.Tensor, offs: torch.Tensor, math: ExpertMath,
                  R: int) -> torch.Tensor:
    """`swiglu_grouped` with every used slot's rows padded with zero rows to at least R (fp32 CPU kernels round a
    row differently in a group of 1-3 rows than of >= 4): rows_in [n, D] sorted by `slot` [n] (S: another group's
    row), `offs` [S] → [n, D] in the same order (other groups' rows: whatever). All on the device, no host read:
    the padded layout has a fixed size, n + (R - 1)·min(S, n) rows."""
    n, S = rows_in.shape[0], offs.shape[0]
    ends = offs.long()
    cnt = torch.diff(ends, prepend=ends.new_zeros(1))
    starts = ends - cnt
    padded = torch.where(cnt > 0, cnt.clamp(min=R), cnt)
    pend = padded.cumsum(0)  # [S] end row of each slot's padded rows
    P = n + (R - 1) * min(S, n)
    i = _arange(n, rows_in.device)
    s = slot.clamp(max=S - 1)
    pos = torch.where(slot < S, pend[s] - padded[s] + i - starts[s], i + (P - n))  # other groups' rows: past pend[-1]
    x = rows_in.new_zeros(P, rows_in.shape[1]).index_copy_(0, pos, rows_in)
    pslot = torch.searchsorted(pend, _arange(P, rows_in.device), right=True) if g.gate_up_bias is not None else None
    y = swiglu_grouped(x, g, pend.to(torch.int32), pslot, math, live=pend[-1])
    return y[pos]


_ARANGE: dict = {}


def _arange(n: int, device: torch.device) -> torch.Tensor:
    """arange(n) on `device`, made once per (n, device)."""
    key = (n, device)
    if key not in _ARANGE:
        _ARANGE[key] = torch.arange(n, device=device)
    return _ARANGE[key]


class MoEBlock(nn.Module):
    rows = 1  # see `layers.linear` and `routed_experts`; set on a deterministic model

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.math = ExpertMath.of(cfg)
        self.capacity = cfg.capacity(layer)  # NLLB-MoE's encoder layers: the capacity rule over a forward's tokens
        self.router = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=cfg.router_bias)
        if cfg.score_correction_bias:
            self.correction_bias = nn.Parameter(torch.zeros(cfg.num_experts))
        if cfg.shared_expert_intermediate_size:
            self.shared = DenseMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size)
            if cfg.shared_expert_gate:
                self.shared_gate = nn.Linear(cfg.hidden_size, 1, bias=False)

    def route(self, x: torch.Tensor):
        """x [N, D] → logits [N, E], weights [N, K] fp32, ids [N, K]."""
        cfg, w, x_in = self.cfg, self.router.weight, x
        x = x if x.dtype == w.dtype else x.to(w.dtype)  # sigmoid routers, NLLB-MoE: fp32 w
        logits = linear(x, w, self.router.bias, self.rows)
        weights, ids = route(cfg.model_type, logits, top_k=cfg.top_k, norm_topk_prob=cfg.norm_topk_prob,
                             correction_bias=self.correction_bias if cfg.score_correction_bias else None,
                             n_group=cfg.n_group, topk_group=cfg.topk_group, scale=cfg.routed_scaling_factor,
                             input_dtype=x_in.dtype, capacity=self.capacity)
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
            shared = self.shared(x)
            out = out + (sigmoid(linear(x, self.shared_gate.weight, None, self.rows)) * shared
                         if self.cfg.shared_expert_gate else shared)
        return out

    def experts_forward(self, x, weights, ids, ctx: ForwardContext) -> torch.Tensor:
        routing = Routing(ids, weights, self.cfg.num_experts, padded=ctx.padding is not None,
                          real_tokens=ctx.real_tokens)
        if ctx.draft_slots is not None:
            return routed_experts(x, routing, (ctx.draft_slots[self.layer],), self.math, self.rows)
        for obs in ctx.observers:
            obs(self.layer, routing)
        return routed_experts(x, routing, ctx.provider.fetch(self.layer, routing), self.math, self.rows)
