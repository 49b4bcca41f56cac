"""Hardware profiles from published figures, and the predicted-throughput table of `specmoe plan`.

A profile turns a model's shapes into cost-model coefficients by a roofline: a matrix product over n rows
takes max(FLOPs / peak, bytes / memory bandwidth) plus kernel-launch overhead, an expert read takes the
link's (or SSD's) latency plus bytes / bandwidth. The figures are vendors' published peaks, derated where
noted; every row built from them is a prediction, never a measurement.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from specmoe.decoding.control.controller import Controller
from specmoe.decoding.control.learning import Acceptance
from specmoe.decoding.control.costmodel import Coefficients, CostModel
from specmoe.decoding.control.routing import RoutingStats


@dataclass(frozen=True)
class Hardware:
    name: str
    description: str
    flops: float          # dense bf16 FLOP/s the GEMMs reach (derated from the peak)
    mem_gbps: float       # memory bandwidth of the compute device, GB/s
    link_gbps: float      # backing tier → compute device, GB/s
    link_latency_us: float
    launch_us: float      # per kernel / op dispatch
    sync_us: float        # per host synchronisation (one per MoE layer: the union must be known to fetch it)
    source: str


# Published figures: NVIDIA H100 SXM5 (989 TFLOPS dense BF16, 3.35 TB/s HBM3) and H200 (989 TFLOPS, 4.8 TB/s
# HBM3e) datasheets; PCIe 5.0 x16 = 64 GB/s per direction, ~50 GB/s reached by pinned host-to-device copies.
# A 16-core desktop: AMD Ryzen 9 7950X (16 Zen 4 cores, AVX-512, DDR5-5200 dual channel = 83 GB/s peak) with a
# PCIe 4.0 NVMe SSD (Samsung 990 PRO: 7.45 GB/s sequential read, ~50-100 µs read latency).
PROFILES = {
    "h100-pcie5": Hardware("h100-pcie5", "NVIDIA H100 SXM, experts in host RAM over PCIe 5.0 x16", flops=989e12 * 0.5,
                           mem_gbps=3350 * 0.8, link_gbps=50, link_latency_us=10, launch_us=5, sync_us=15,
                           source="H100 datasheet (989 TFLOPS BF16, 3.35 TB/s); PCIe 5.0 x16 64 GB/s, ~50 reached"),
    "h200-pcie5": Hardware("h200-pcie5", "NVIDIA H200, experts in host RAM over PCIe 5.0 x16", flops=989e12 * 0.5,
                           mem_gbps=4800 * 0.8, link_gbps=50, link_latency_us=10, launch_us=5, sync_us=15,
                           source="H200 datasheet (989 TFLOPS BF16, 4.8 TB/s); PCIe 5.0 x16 64 GB/s, ~50 reached"),
    "desktop-nvme4": Hardware("desktop-nvme4", "16-core desktop CPU (Ryzen 9 7950X class), experts on a PCIe 4.0 "
                              "NVMe SSD", flops=1.0e12, mem_gbps=83 * 0.75, link_gbps=7.0, link_latency_us=80,
                              launch_us=3, sync_us=0,
                              source="Ryzen 9 7950X (16 cores, AVX-512, DDR5-5200 2ch 83 GB/s); NVMe gen4 "
                                     "(990 PRO 7.45 GB/s read)"),
}


def _gemm(h: Hardware, rows: float, params: float, bytes_per: int) -> tuple[float, float]:
    """(fixed, per row) seconds of a product with `params` weights: weight bytes over memory bandwidth plus
    one launch, and 2·params FLOPs per row."""
    return params * bytes_per / (h.mem_gbps * 1e9) + h.launch_us * 1e-6, 2 * params / h.flops


def coefficients(h: Hardware, cfg, bytes_per: int = 2, draft_experts: int = 4) -> Coefficients:
    """Cost-model coefficients of `cfg` on `h` (bf16 unless told)."""
    D, hd = cfg.hidden_size, cfg.head_dim
    attn = D * (cfg.num_heads + 2 * cfg.num_kv_heads) * hd + cfg.num_heads * hd * D
    dense = 3 * D * cfg.dense_intermediate_size
    per_layer = attn + D * cfg.num_experts + 3 * D * cfg.shared_expert_intermediate_size
    params = cfg.num_layers * per_layer + (cfg.num_layers - len(cfg.moe_layers)) * dense + cfg.vocab_size * D
    ne0, ne1 = _gemm(h, 1, params, bytes_per)
    ne0 += cfg.num_layers * 12 * h.launch_us * 1e-6  # norms, rope, attention, residuals
    e0, e1 = _gemm(h, 1, cfg.expert_numel, bytes_per)
    e0 += 2 * h.launch_us * 1e-6
    eb = cfg.expert_numel * bytes_per
    # a draft forward: the non-expert model + per MoE layer N draft experts as two dense GEMMs (+ 4 small ops)
    nd = draft_experts
    d0 = ne0 + len(cfg.moe_layers) * (nd * cfg.expert_numel * bytes_per / (h.mem_gbps * 1e9) + 6 * h.launch_us * 1e-6)
    d1 = ne1 + len(cfg.moe_layers) * nd * 2 * cfg.expert_numel / h.flops
    return Coefficients(ne_fixed=ne0, ne_per_token=ne1, layer_fixed=h.sync_us * 1e-6 + 8 * h.launch_us * 1e-6,
                        draft_fixed=d0, draft_per_token=d1,
                        exp_fixed=e0, exp_per_row=e1, read_s=eb / (h.link_gbps * 1e9),
                        read_latency_s=h.link_latency_us * 1e-6, expert_bytes=eb, moe_layers=len(cfg.moe_layers),
                        top_k=cfg.top_k, num_experts=cfg.num_experts, source=h.name)


def routing_from_profile(cfg, counts: list[list[int]] | None) -> RoutingStats:
    """Per-token pick probabilities from an expert profile (uniform without one)."""
    rs = RoutingStats(list(cfg.moe_layers), cfg.num_experts, cfg.top_k)
    if counts:
        c = np.asarray(counts, float)[: len(cfg.moe_layers)]
        tot = c.sum(1, keepdims=True)
        rs.p = np.where(tot > 0, c / np.maximum(tot, 1) * cfg.top_k, rs.p)
    return rs


def predict(coef: Coefficients, routing: RoutingStats, *, batches, draft_experts: int, gamma: int,
            cache_slots: int, acceptance: list[float] | None = None) -> list[dict]:
    """Predicted tokens/s per batch size of plain decoding (every expert fetched per layer, no cache), an
    LRU expert cache of `cache_slots` per layer (modelled as holding each layer's hottest experts) and
    SpecMoE (the same cache with the hottest `draft_experts` pinned as the draft set; γ per the controller's
    best speculative plan)."""
    cm = CostModel(coef, routing, draft_experts=draft_experts)
    ctl = Controller(cm, gamma)
    if acceptance:
        ctl.acc = Acceptance(gamma)
        a = np.asarray(list(acceptance)[:gamma] + [0.0] * max(0, gamma - len(acceptance)))  # P_j by position
        reached = np.concatenate([[1.0], a[:-1]])  # a chain's node j is reached when draft j - 1 was accepted
        ctl.acc.reach[:, 0], ctl.acc.hit[:, 0], ctl.acc.drafted = reached * 1e6, a * 1e6, np.full(gamma, 1e6)
    L, E = routing.p.shape
    none = np.zeros((L, E), bool)
    lru = routing.hottest(cache_slots)
    rows = []
    for B in batches:
        plan = ctl.plan(list(range(B)), [gamma] * B, lru, lru | routing.hottest(draft_experts))
        g = plan.spec_gammas or [0] * B
        rows.append({"batch": B, "plain_tok_s": B / cm.plain(B, none), "lru_tok_s": B / cm.plain(B, lru),
                     "specmoe_tok_s": plan.spec_rate, "gamma": int(max(g)), "draft_experts": draft_experts,
                     "choice": plan.kind, "label": "predicted"})
    return rows

