"""A calibrated step-time model (the roofline idea of SpecMoEOff, with coefficients measured here).

Time of one forward over n tokens:

    T(n) = t_ne(n) + Σ_layers (layer_fixed + expert_layer(n, union_l, misses_l))
    t_ne(n)  = ne_fixed + ne_per_token · n            per-forward overhead + non-expert compute (all layers)
    expert_layer = max(compute, fetch + compute / union) when it misses (the engine computes resident experts
                   while misses load, then each miss after its load), compute otherwise
    compute  = union · exp_fixed + n·K · exp_per_row  (each used expert once over its tokens)
    fetch    = read_latency + misses · read_s         (one I/O thread, like one link)

A plain step is one forward over B tokens; a speculative step is the draft forwards (one per drafted
position over the sequences still drafting, draft experts only, no fetches) plus one verification forward
over B + Σγ_b tokens, whose non-expert model runs B · (1 + max γ_b) (ragged rows are padded; padding routes
to no expert). Unions and misses come from recent routing (`RoutingStats`: per-layer EMA of how
often each expert is picked per token) and the resident set at the start of the step.

The coefficients come from short micro-measurements (`calibrate`: forwards by row count with the expert
computation stubbed out and with every expert resident, one expert FFN by row count at the model's shapes,
cold fetches of 1 and 4 experts from the store), cached per machine + model + tier as JSON in the user cache directory, and
are refined online (`refinement.py`): measured / predicted time of target forwards per batch bucket as a line in
log2(tokens per row) (plain steps and verifications alike), an EMA of it for draft phases per batch bucket, and per
step kind an EMA of measured / predicted misses (tokens of one sequence route alike, so a verification's union is
smaller than independent tokens would give).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from specmoe.decoding import expert_union
from specmoe.decoding.control.refinement import Refinement, bucket
from specmoe.decoding.control.routing import RoutingStats
from specmoe.decoding.runtime.breakdown import now

CALIBRATION_VERSION = 5  # 5: experts in their stored dtype on the native kernels
LOOKUP_DRAFTERS = ("ngram",)
LOOKUP_ROW_S = 2e-5  # host seconds per row of a lookup proposal (prior; refined online)
EAGLE_LAYERS = 1.5   # an EAGLE head's forward as this many of the draft's layers (prior; refined online)
KINDS = ("plain", "spec")


@dataclass
class Coefficients:
    """Seconds; see the module docstring for the model they enter."""
    ne_fixed: float
    ne_per_token: float
    layer_fixed: float       # the expert path's own overhead per MoE layer (routing sort, host read, scatter)
    draft_fixed: float       # one draft forward (N draft experts per layer as two dense GEMMs): fixed, per token
    draft_per_token: float
    exp_fixed: float
    exp_per_row: float
    read_s: float            # each expert read from the backing tier after the first (0: every expert resident)
    read_latency_s: float    # added once per layer that misses (I/O thread wake-up, first-byte latency)
    expert_bytes: int
    moe_layers: int
    top_k: int
    num_experts: int
    source: str = "measured"  # "measured" | "cached" | a hardware profile's name

    @property
    def read_gbps(self) -> float | None:
        return self.expert_bytes / self.read_s / 1e9 if self.read_s > 0 else None


def cache_root() -> Path:
    """The user cache directory ($XDG_CACHE_HOME/specmoe or ~/.cache/specmoe)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "specmoe"


def machine_key() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{platform.node()}|{cpu}|{os.cpu_count()}|torch {torch.__version__}|threads {torch.get_num_threads()}"


def calibration_key(*, model_fingerprint: str, dtype, device, tier: str) -> str:
    raw = f"v{CALIBRATION_VERSION}|{machine_key()}|{model_fingerprint}|{dtype}|{device}|{tier}"
    return hashlib.sha1(raw.encode()).hexdigest()[:16]


def _fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares a + b·x with a, b >= 0."""
    b, a = np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)
    b = max(float(b), 0.0)
    a = max(float(np.mean(ys) - b * np.mean(xs)), 0.0)
    return a, b


def _best(f, repeats: int = 3) -> float:
    f()  # warm-up
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def _same_expert_slots(buf: torch.Tensor, cfg, n: int, slot_of: torch.Tensor):
    """A SlotGroup of n slots that all hold the expert `buf` (calibration: every expert costs the same), rows
    64-byte aligned like the stores' slots so the grouped matmul takes the same form."""
    from specmoe.experts.buffers import expert_views
    from specmoe.memory import round_up
    from specmoe.models.moe import SlotGroup
    es = buf.element_size()
    stride = round_up(buf.numel() * es, 64) // es
    rows = torch.empty(n, stride, dtype=buf.dtype, device=buf.device)[:, : buf.numel()]
    rows.copy_(buf.expand(n, -1))
    return SlotGroup.over(expert_views(rows, cfg), slot_of)


class _SameExperts:
    """A stand-in expert store for calibration: every expert of every layer is the same resident buffer."""

    def __init__(self, buf: torch.Tensor, cfg):
        E = cfg.num_experts  # slot e = expert e; E (padding) -> outside the group
        self.group = _same_expert_slots(buf, cfg, E, torch.arange(E + 1, device=buf.device))

    def fetch(self, layer: int, routing):
        yield self.group


@torch.inference_mode()
def measure_forwards(model, device, buf: torch.Tensor, rows=(1, 8, 64), draft_experts: int = 4) -> dict:
    """Forwards over n tokens (one per sequence, a few positions of context) through the real expert path with
    every expert resident (→ "full"; the seconds outside the routed experts → "nonexpert": attention, norms,
    routers, shared experts, lm_head, per-forward overhead), and as a draft forward computes (every token
    routed onto N draft slots read in place → "draft"). {"rows", "nonexpert", "full", "draft", "unions"}:
    seconds and mean union sizes per row count."""
    from specmoe.decoding.runtime.runner import ModelRunner
    from specmoe.models.kv_cache import KVCache
    from specmoe.models.moe import ForwardContext
    cfg = model.cfg
    dtype = model.compute_dtype
    heads, kdim, vdim = cfg.kv_cache_dims
    cache = KVCache(num_layers=cfg.num_layers, max_batch=max(rows), max_seq=16, num_kv_heads=heads, head_dim=kdim,
                    v_head_dim=vdim, dtype=dtype, device=device)
    cache.lengths = [4] * max(rows)
    runner = ModelRunner(model, None, cache, device)
    g = torch.Generator(device="cpu").manual_seed(0)
    out = {"rows": list(rows), "nonexpert": [], "full": [], "unions": [], "draft": []}
    store = _SameExperts(buf, cfg)
    E = cfg.num_experts
    nd = max(1, min(draft_experts, E))
    sub = torch.cat([torch.arange(E, device=device) % nd, torch.tensor([nd], device=device)])  # E (padding) -> S
    draft_group = _same_expert_slots(buf, cfg, nd, sub)
    draft_slots = {layer: draft_group for layer in cfg.moe_layers}
    for n in rows:
        tokens = torch.randint(cfg.vocab_size, (n, 1), generator=g).to(device)
        bv = runner.batch_view(list(range(n)), [1] * n)
        unions: list[int] = []
        expert_s: list[float] = []

        def full():
            unions.clear()
            ctx = ForwardContext(provider=store, observers=[lambda layer, r: unions.append(len(r.needed))])
            t0 = time.perf_counter()
            model(tokens, cache, bv, ctx)
            now(device)
            expert_s.append(ctx.expert_s / max(time.perf_counter() - t0, 1e-12))

        def drafted():
            model(tokens, cache, bv, ForwardContext(provider=None, draft_slots=draft_slots))
            now(device)
        out["draft"].append(_best(drafted))
        t_full = _best(full)
        out["full"].append(t_full)
        out["nonexpert"].append(t_full * (1 - float(np.median(expert_s))))
        out["unions"].append(sum(unions) / max(1, len(unions)))
    return out


@torch.inference_mode()
def measure_expert(cfg, dtype, device, rows=(1, 4, 16, 64), slot_dtype: torch.dtype | None = None
                   ) -> tuple[float, float]:
    """(fixed, per row) seconds of one expert FFN at the model's shapes: n rows routed to one slot holding it in
    `slot_dtype` (the store's; default `dtype`), through the MoE block's own routed-expert path."""
    from specmoe.models.moe import ExpertMath, Routing, routed_experts
    D = cfg.hidden_size
    g = torch.Generator(device="cpu").manual_seed(0)
    buf = (torch.randn(cfg.expert_numel, generator=g) * 0.02).to(device=device, dtype=slot_dtype or dtype)
    E = cfg.num_experts
    slot_of = torch.ones(E + 1, dtype=torch.long, device=device)
    slot_of[0] = 0
    group = _same_expert_slots(buf, cfg, 1, slot_of)
    math = ExpertMath.of(cfg)
    ts = []
    for n in rows:
        x = torch.randn(n, D, generator=g).to(device=device, dtype=dtype)
        routing = Routing(torch.zeros(n, 1, dtype=torch.long, device=device), torch.ones(n, 1, device=device), E)
        ts.append(_best(lambda: (routed_experts(x, routing, (group,), math), now(device))))
    return _fit(list(rows), ts)


def measure_reads(store, cfg) -> tuple[float, float]:
    """(seconds per expert, latency) of cold fetches of 1 and 4 experts through the store (its I/O thread,
    checksum verification included), taken on experts that are not resident. (0, 0) for resident stores."""
    from specmoe.models.moe import Routing
    layer = cfg.moe_layers[-1]
    ts = {}
    for k in (1, 4):
        best = math.inf
        for _ in range(2):
            store.evict_all()
            res = store.resident(layer)
            ids = [e for e in range(cfg.num_experts) if e not in res][:k]
            if len(ids) < k:
                return 0.0, 0.0
            routing = Routing(torch.tensor(ids, device=store.device)[:, None],
                              torch.ones(k, 1, device=store.device), cfg.num_experts)
            t0 = time.perf_counter()
            for _group in store.fetch(layer, routing):
                pass
            best = min(best, time.perf_counter() - t0)
        ts[k] = best
    store.evict_all()
    per = max((ts[4] - ts[1]) / 3, ts[1] * 0.1)
    return per, max(ts[1] - per, 0.0)


def calibrate(model, store, device, *, tier: str, draft_experts: int = 4) -> Coefficients:
    cfg = model.cfg
    dtype = model.compute_dtype
    slot_dtype = store.slot_tensors(cfg.moe_layers[0])[0].dtype  # experts as the store holds them
    if not slot_dtype.is_floating_point:  # quantized stored slots: priced as the compute dtype (an approximation)
        slot_dtype = dtype
    e0, e1 = measure_expert(cfg, dtype, device, slot_dtype=slot_dtype)
    buf = (torch.randn(cfg.expert_numel, generator=torch.Generator().manual_seed(1)) * 0.02).to(device=device,
                                                                                              dtype=slot_dtype)
    fw = measure_forwards(model, device, buf, draft_experts=draft_experts)
    ne0, ne1 = _fit(fw["rows"], fw["nonexpert"])
    d0, d1 = _fit(fw["rows"], fw["draft"])
    L = len(cfg.moe_layers)
    over = [(f - z - L * (u * e0 + n * cfg.top_k * e1)) / L
            for n, f, z, u in zip(fw["rows"], fw["full"], fw["nonexpert"], fw["unions"])]
    read, lat = measure_reads(store, cfg) if tier != "none" else (0.0, 0.0)
    esize = torch.empty((), dtype=slot_dtype).element_size()
    return Coefficients(ne_fixed=ne0, ne_per_token=ne1, layer_fixed=max(0.0, float(np.median(over))),
                        draft_fixed=d0, draft_per_token=d1, exp_fixed=e0,
                        exp_per_row=e1, read_s=read, read_latency_s=lat, expert_bytes=cfg.expert_numel * esize,
                        moe_layers=L, top_k=cfg.top_k, num_experts=cfg.num_experts)


def load_or_calibrate(model, store, device, *, tier: str, key: str, draft_experts: int = 4,
                      refresh: bool = False) -> Coefficients:
    """Coefficients from `<cache>/costmodel/<key>.json`, or measured now and written there."""
    f = cache_root() / "costmodel" / f"{key}.json"
    if f.is_file() and not refresh:
        try:
            d = json.loads(f.read_text())
            d["source"] = "cached"
            return Coefficients(**d)
        except (OSError, ValueError, TypeError):
            pass  # unreadable or from another version: measure again
    c = calibrate(model, store, device, tier=tier, draft_experts=draft_experts)
    try:
        f.parent.mkdir(parents=True, exist_ok=True)
        tmp = f.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(c), indent=1))
        tmp.replace(f)
    except OSError:
        pass  # a read-only cache directory only costs a re-measurement next time
    return c


class CostModel:
    """Predicts plain and speculative step times (module docstring); `refine` folds measured steps in."""

    RHO_ALPHA = 0.1

    def __init__(self, coef: Coefficients, routing: RoutingStats, *, draft_experts: int):
        self.c, self.routing, self.nd = coef, routing, draft_experts
        self.ref = Refinement()
        # the routing a drafted token adds to a verification, as a fraction of an independent token's: drafts
        # continue their sequence, whose consecutive tokens pick alike (1 = independent; measured, `fold_union`)
        self.rho = 1.0
        self.union_obs: list[tuple[int, float, float]] = []  # (tokens, observed union, predicted union) recent

    @property
    def read_s(self) -> float:
        """Seconds per expert read from the backing tier (the calibrated coefficient)."""
        return self.c.read_s

    def state(self) -> dict:
        """The online refinements (`warm` reads them back): forward fits, draft / overhead EMAs, miss ratios, ρ."""
        return {**self.ref.state(), "rho": self.rho}

    def warm(self, state: dict) -> None:
        """Start from remembered refinements (a `state`; malformed entries are skipped)."""
        self.ref.warm(state)
        if isinstance(state.get("rho"), (int, float)):
            self.rho = min(max(float(state["rho"]), 0.02), 1.0)

    def effective(self, B, drafted) -> np.ndarray:
        """Independent-token equivalents of a forward over B pending tokens and `drafted` draft tokens (what the
        expected union is taken over)."""
        return B + self.rho * np.asarray(drafted, float)

    def fold_union(self, B: int, drafted: int) -> None:
        """Fold the last verification's observed expert union into ρ: the independent-token count m whose
        expected union (under the routing frequencies before it) equals the observed one, m = B + ρ·drafted.
        Skipped when the forward routed padding (ragged rows) or drafted nothing."""
        last = self.routing.last
        if last is None or drafted <= 0:
            return
        n, u_obs, p = last
        if abs(n - (B + drafted)) > 0.5:
            return
        p = np.clip(p, 0.0, 1.0)
        predicted = float(expert_union.union_hit(p, self.effective(B, drafted))[0].sum())
        grid = np.linspace(B, B + drafted, 33)  # the expected union is increasing in m: read m off a grid
        curve = expert_union.union_hit(p[None], grid[:, None, None])[0].sum((1, 2))
        m = float(np.interp(u_obs, curve, grid)) if u_obs < curve[-1] else float(grid[-1])
        r = min(max((m - B) / drafted, 0.02), 1.0)
        self.rho = (1 - self.RHO_ALPHA) * self.rho + self.RHO_ALPHA * r
        if len(self.union_obs) < 4096:
            self.union_obs.append((B + drafted, u_obs, predicted))

    # -------------------------------------------------------------- pieces
    def expected_union(self, n: np.ndarray, resident: np.ndarray, kind: str) -> tuple[np.ndarray, np.ndarray]:
        """Expected (union, misses) per layer [C, L] for forwards of n [C] independent tokens; `resident`
        [L, E] bool. Misses are scaled by the kind's measured/predicted EMA. The formula is
        `expert_union.union_hit`, the one the tree selection prices its nodes with."""
        p = np.clip(self.routing.p, 0.0, 1.0)[None]  # [1, L, E]
        hit = expert_union.union_hit(p, np.asarray(n, float)[:, None, None])[0]  # [C, L, E]
        union = hit.sum(-1)
        miss = (hit * ~resident[None]).sum(-1) * self.ref.misses.get(kind, 1.0)
        return union, np.minimum(miss, union)

    def forward_time(self, n: np.ndarray, union: np.ndarray, miss: np.ndarray,
                     padded: np.ndarray | None = None) -> np.ndarray:
        """Seconds of target forwards over n [C] tokens with per-layer union / misses [C, L]. `padded` [C]: the
        tokens the forward computes outside the experts when its rows are ragged (B × the longest row: the
        non-expert model runs the padding, the experts do not); None: n."""
        c = self.c
        n = np.asarray(n, float)
        dense = n if padded is None else np.asarray(padded, float)
        comp = union * c.exp_fixed + (n * c.top_k)[:, None] * c.exp_per_row  # [C, L]
        fetch = c.read_latency_s + miss * c.read_s
        per_layer = np.where(miss > 0, np.maximum(comp, fetch + comp / np.maximum(union, 1.0)), comp)
        return c.ne_fixed + c.ne_per_token * dense + (c.layer_fixed + per_layer).sum(-1)

    def verify_line(self, B: int, rows_hint: int | None = None) -> tuple[float, float]:
        """A verification of B pending tokens as a line in the rows its forward computes, t ≈ a + c·rows, without
        the expert reads (the cost-aware tree selection prices those per node; `read_s`): a = the fixed parts and
        the B tokens' expected expert union's fixed compute, c = a computed row's non-expert and expert compute;
        both scaled by the forwards' refinement at this batch (at `rows_hint` tokens, default 2B). This is the
        controller's `forward_time` with every row real, so the selection and the plans price alike."""
        c = self.c
        union, _ = self.expected_union(np.array([B]), np.zeros_like(self.routing.p, dtype=bool), "spec")
        a = c.ne_fixed + float((c.layer_fixed + union[0] * c.exp_fixed).sum())
        per_row = c.ne_per_token + c.moe_layers * c.top_k * c.exp_per_row
        r = self.ratio(self.fwd(B), rows_hint if rows_hint is not None else 2 * B)
        return a * r, per_row * r

    def draft_time(self, rows: np.ndarray) -> np.ndarray:
        """Seconds of draft forwards over rows [...] tokens each (draft experts only, no fetches: the measured
        dense form, an upper bound where the draft's grouped form is faster); 0 rows cost nothing."""
        c = self.c
        r = np.asarray(rows, float)
        return np.where(r > 0, c.draft_fixed + c.draft_per_token * r, 0.0)

    def drafter_time(self, name: str, rows: np.ndarray) -> np.ndarray:
        """Raw seconds of drafter `name`'s forwards over rows [...] sequences each (one per draft depth): the
        self draft's measured form (`draft_time`); an EAGLE head, a prior of one decoder layer's share of the
        draft forward until measured steps refine it (`refine("draft:eagle", ...)`); a lookup, host work per
        row."""
        r = np.asarray(rows, float)
        if name == "self":
            return self.draft_time(r)
        if name in LOOKUP_DRAFTERS:
            return np.where(r > 0, LOOKUP_ROW_S * r, 0.0)
        return self.draft_time(r) * (EAGLE_LAYERS / max(self.c.moe_layers, 1))

    # -------------------------------------------------------------- steps
    def plain_parts(self, B: int, resident: np.ndarray) -> tuple[float, float]:
        """(raw seconds, refined seconds) of a plain step: one target forward over B tokens."""
        union, miss = self.expected_union(np.array([B]), resident, "plain")
        t = float(self.forward_time(np.array([B]), union, miss)[0])
        return t, t * self.ratio(self.fwd(B), B)

    def plain(self, B: int, resident: np.ndarray, *, refined: bool = True) -> float:
        raw, ref = self.plain_parts(B, resident)
        return ref if refined else raw

    def spec_parts(self, gammas: np.ndarray, resident: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per row of gammas [C, B] (γ_b drafted tokens for sequence b; `resident` includes the draft set):
        raw draft seconds, raw verification seconds [C] and the refined total [C]."""
        g = np.atleast_2d(np.asarray(gammas))
        C, B = g.shape
        G = int(g.max()) if g.size else 0
        rows = (g[:, :, None] > np.arange(G)[None, None, :]).sum(1)  # [C, G] sequences drafting position j
        draft = self.draft_time(rows).sum(1)
        n = B + g.sum(1)
        union, miss = self.expected_union(self.effective(B, g.sum(1)), resident, "spec")
        verify = self.forward_time(n, union, miss, B * (1 + g.max(1)))
        fwd = np.array([self.ratio(self.fwd(B), int(k)) for k in n])
        return draft, verify, draft * self.ratio("draft", B) + verify * fwd

    def spec(self, gammas: np.ndarray, resident: np.ndarray, *, refined: bool = True) -> np.ndarray:
        d, v, ref = self.spec_parts(gammas, resident)
        return ref if refined else d + v

    @staticmethod
    def fwd(B: int) -> str:
        """The part name of target forwards over a batch of B sequences (`ratio`, `refine`): their corrections
        are kept per batch bucket, as a function of the token count, since 4 tokens of one sequence (a
        verification at batch 1) and of four (a plain step at batch 4) are different forwards for the model's
        error."""
        return f"fwd/{bucket(B)}"

    def ratio(self, part: str, n: int) -> float:
        """Measured / predicted time of a part (`fwd(B)`: target forwards at batch B over n tokens; "draft:<d>":
        draft phases at batch n) from the refinements (`Refinement.ratio`: forwards at a batch size never
        measured take the nearest measured batch size's at the same tokens per row); a draft phase never
        measured takes the forwards' ratio at its batch size (both are mostly the non-expert model); 1 before
        anything is measured."""
        r = self.ref.ratio(part, n)
        if r is not None:
            return r
        return self.ratio(self.fwd(n), n) if part.startswith("draft") else 1.0

    def refine(self, part: str, n: int, measured_s: float, raw_predicted_s: float) -> None:
        """Fold in one measured part of a step (`raw_predicted_s`: its prediction without refinement)."""
        if raw_predicted_s > 0 and measured_s > 0:
            self.ref.refine(part, n, measured_s / raw_predicted_s)

    def overhead(self, kind: str, B: int, tokens=None):
        """Seconds a step of this kind at batch B spends outside its modelled forwards (sampling, acceptance,
        selection, KV compaction, host bookkeeping) when its forward computes `tokens` positions (None: B; a
        verification: B · (1 + the longest draft), since acceptance and sampling run over every padded position),
        measured online per computed token and batch bucket (nearest bucket until measured)."""
        t = self.ref.overhead
        b = bucket(B)
        if (kind, b) in t:
            per = t[(kind, b)]
        else:
            near = [k for k in t if k[0] == kind]
            per = t[min(near, key=lambda k: abs(math.log2(k[1]) - math.log2(b)))] if near else 0.0
        return per * (B if tokens is None else np.asarray(tokens, float))

    def refine_overhead(self, kind: str, B: int, seconds: float, tokens: int | None = None) -> None:
        key, a = (kind, bucket(B)), self.ref.alpha
        per = max(seconds, 0.0) / (B if tokens is None else tokens)
        old = self.ref.overhead.get(key)
        self.ref.overhead[key] = per if old is None else (1 - a) * old + a * per

    def refine_misses(self, kind: str, measured: float, predicted: float) -> None:
        if predicted > 0.5:
            self.ref.ema(self.ref.misses, kind, measured / predicted * self.ref.misses.get(kind, 1.0))

    def stats(self) -> dict:
        obs = np.array(self.union_obs[-512:]).reshape(-1, 3)
        err = np.abs(obs[:, 2] - obs[:, 1]) / np.maximum(obs[:, 1], 1) if len(obs) else np.zeros(0)
        return {"draft_routing_rho": self.rho,
                "union_prediction_error": float(np.median(err)) if len(err) else None,
                "coefficients": {**asdict(self.c), "read_gbps": self.c.read_gbps},
                **self.ref.stats(),
                "miss_refinement": dict(self.ref.misses),
                "step_overhead_s_per_token": {f"{k}@{b}": v for (k, b), v in sorted(self.ref.overhead.items())}}
