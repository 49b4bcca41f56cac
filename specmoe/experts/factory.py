"""Build the ExpertProvider an OffloadConfig asks for."""
from __future__ import annotations

import math
import warnings

import torch

from specmoe.engine.options import OffloadConfig
from specmoe.errors import InputError
from specmoe.experts.memory import check_budget_value, round_up
from specmoe.experts.resident import ResidentExperts
from specmoe.weights.checkpoint import Checkpoint


def cache_slots(ckpt: Checkpoint, cfg: OffloadConfig, slot_nbytes: int) -> int:
    """Slots per MoE layer from cache_experts, cache_bytes or memory_budget (default: E/4, at least top-k)."""
    mc = ckpt.config
    if cfg.cache_experts is not None and cfg.cache_bytes is not None:
        raise InputError("set cache_experts or cache_bytes, not both")
    if cfg.cache_experts is not None:
        return cfg.cache_experts
    per_slot = slot_nbytes * len(mc.moe_layers)
    if cfg.cache_bytes is not None:
        return cfg.cache_bytes // per_slot
    default = max(mc.top_k, math.ceil(mc.num_experts / 4))
    if cfg.memory_budget is not None:
        return min(default, cfg.memory_budget // per_slot)
    return default


def build_provider(ckpt: Checkpoint, cfg: OffloadConfig, *, dtype: torch.dtype, device: torch.device,
                   progress: bool = False, model=None):
    """`model` (the loaded Transformer) gives predicted prefetch its routers and lets the static policy
    profile the model when the checkpoint ships no expert_profile.json."""
    device = torch.device(device)
    check_budget_value("memory_budget", cfg.memory_budget, device)
    check_budget_value("cache_bytes", cfg.cache_bytes, device)
    if cfg.offload == "none":
        return ResidentExperts(ckpt, dtype, device, progress=progress)
    from specmoe.experts.cache import ExpertCache
    from specmoe.experts.tiers import DiskTier, EmulatedLink, HostTier
    mc = ckpt.config
    elt = torch.empty((), dtype=dtype).element_size()
    stride = round_up(mc.expert_numel * elt) if cfg.offload == "disk" else round_up(mc.expert_numel * elt, 64)
    slots = cache_slots(ckpt, cfg, stride)
    if slots < mc.top_k:  # before any allocation or repack
        raise InputError(f"the expert cache holds {slots} expert(s) per MoE layer, fewer than the {mc.top_k} (top-k) "
                         f"a single token needs; raise cache_experts (or cache_bytes) to at least {mc.top_k}")
    link = None
    if cfg.offload == "host":
        emulate = cfg.link_gbps is not None or cfg.link_latency_us is not None
        if emulate and device.type == "cuda":
            raise InputError("the emulated link is for CPU runs; on CUDA the real host-device link is used")
        budget = cfg.memory_budget - slots * stride * len(mc.moe_layers) if cfg.memory_budget else None
        tier = HostTier(ckpt, dtype, pin=device.type == "cuda",
                        link=EmulatedLink(cfg.link_gbps, cfg.link_latency_us) if emulate else None,
                        budget=budget, progress=progress)
        if emulate:
            link = {"link_gbps": cfg.link_gbps, "link_latency_us": cfg.link_latency_us or 0.0}
    else:
        from specmoe.experts.repack import open_repack
        tier = DiskTier(open_repack(ckpt, dtype, cfg.repack_dir, progress=progress))
    cache = ExpertCache(tier, mc, slots=slots, policy=cfg.cache_policy, prefetch=cfg.prefetch, device=device,
                        memory_budget=cfg.memory_budget, link=link)
    if model is not None:
        cache.attach_model(model)
    if cfg.cache_policy == "static":
        cache.set_static(static_hot_set(ckpt, cfg, cache, model, dtype=dtype, device=device))
    return cache


def static_hot_set(ckpt: Checkpoint, cfg: OffloadConfig, cache, model, *, dtype, device) -> dict[int, list[int]]:
    """The hottest ~10% experts per layer: from <checkpoint>/expert_profile.json, else from a cached profile,
    else from a short profiling run (cached next to the repack for the next start)."""
    from specmoe.experts import profiling
    from specmoe.experts.repack import candidate_dirs, writable
    mc = ckpt.config
    shipped = ckpt.path / "expert_profile.json"
    cached = [d / "expert_profile.json" for d in candidate_dirs(ckpt, cfg.repack_dir)]
    if shipped.is_file():
        return profiling.hot_experts(profiling.load_profile(shipped, mc), mc)
    for p in cached:  # an auto profile counts only for the weights it was made from
        if p.is_file() and profiling.profile_fingerprint(p) == ckpt.fingerprint():
            return profiling.hot_experts(profiling.load_profile(p, mc), mc)
    if model is None:
        raise InputError("cache_policy='static' needs an expert profile: add expert_profile.json to the checkpoint "
                         "(`specmoe profile`) or build the provider with the model so it can profile itself")
    warnings.warn(f"{ckpt.path} has no expert_profile.json; profiling the model on built-in prompts for the "
                  "static cache policy (run `specmoe profile` for a better profile)", stacklevel=3)
    counts = profiling.collect_counts(model, cache, profiling.default_token_lists(ckpt.path, mc), device=device,
                                      dtype=dtype)
    cache.reset_stats()
    for p in cached:
        if writable(p.parent) is None:
            profiling.save_profile(p, profiling.profile_dict(counts, mc, source="specmoe static-policy auto profile",
                                                             fingerprint=ckpt.fingerprint()))
            break
    return profiling.hot_experts(counts, mc)
