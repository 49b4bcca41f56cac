"""Build the ExpertStore an OffloadConfig asks for."""
from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from specmoe import kernels as native
from specmoe.options import OffloadConfig
from specmoe.errors import InputError
from specmoe.experts.formats import STORED, ExpertShape, Plain, make_format
from specmoe.experts.budget import (SCRATCH_BUFFERS, ExpertMemory, LimitPlan, limit_budget, non_expert_bytes,
                                    plan_offload, plan_resident)
from specmoe.memory import MemoryLimit, check_budget_value, memory_limit, round_up
from specmoe.models.loader import stored_dtype
from specmoe.experts.resident import ResidentExperts
from specmoe.weights.checkpoint import Checkpoint


@dataclass
class StorePlan:
    """Everything build_store decides before allocating or loading anything: the experts' storage format, the
    slot dtype and size, the disk tier's read path, the ExpertMemory plan, and what the memory limit left."""
    fmt: object
    compute: torch.dtype
    dtype: torch.dtype
    expert_bytes: int
    direct: bool
    io_depth: int
    stride: int
    memory: ExpertMemory
    limit: LimitPlan | None = None


def plan_store(ckpt: Checkpoint, cfg: OffloadConfig, *, dtype: torch.dtype, device: torch.device,
               draft_experts: int = 0, limit: MemoryLimit | None = None) -> StorePlan:
    """The StorePlan of build_store; raises (BudgetTooSmallError, MemoryLimitError, ...) before any weight is loaded.
    An offloaded model on the CPU is checked against the memory limit the process runs under (`limit`, default:
    read now from its cgroup and MemAvailable) and, when the user set no cache_experts / cache_bytes /
    memory_budget, its cache is sized to what the limit leaves (budget.py)."""
    device = torch.device(device)
    check_budget_value("memory_budget", cfg.memory_budget, device)
    check_budget_value("cache_bytes", cfg.cache_bytes, device)
    mc = ckpt.config
    fmt = make_format(cfg.expert_format, ExpertShape.of(mc), ckpt.storage_dtype)
    compute, dtype = dtype, slot_dtype(fmt, dtype, device)
    expert_bytes = fmt.slot_bytes(dtype)
    if cfg.offload == "none":
        plan = plan_resident(mc, expert_bytes=expert_bytes, draft_experts=draft_experts,
                             memory_budget=cfg.memory_budget)
        return StorePlan(fmt, compute, dtype, expert_bytes, False, 1, expert_bytes, plan)
    from specmoe.experts.tiers import DiskTier
    # CUDA disk reads land straight in pinned staging rows; CPU ones go through the tier's staging row (tiers.py)
    direct = cfg.offload == "disk" and fmt.identity(dtype) and device.type == "cuda"
    io_depth = 1 if device.type == "cuda" else cfg.io_depth  # CUDA loads go through one staging ring
    stride = round_up(fmt.stored_bytes) if direct else round_up(expert_bytes, 64)
    # CUDA: a tier whose bytes are not the slot's decodes on the host into pinned staging rows first
    staging = device.type == "cuda" and (cfg.offload == "disk" or not fmt.identity(dtype))
    # every part is known before any allocation or repack: a budget too small fails here, with the numbers
    common = dict(offload=cfg.offload, slot_bytes=stride, expert_bytes=expert_bytes, cuda=device.type == "cuda",
                  draft_experts=draft_experts, stored_bytes=fmt.stored_bytes, staging=staging,
                  tier_staging=0 if direct or cfg.offload != "disk" else DiskTier.staging_for(fmt.stored_bytes,
                                                                                            io_depth))
    user_sized = cfg.cache_experts is not None or cfg.cache_bytes is not None or cfg.memory_budget is not None
    lp = None
    if device.type == "cpu":  # the slots, scratch, staging and a host tier all live in the limited host memory
        minimal = plan_offload(mc, **common, cache_experts=max(mc.top_k, min(draft_experts, mc.num_experts)),
                               cache_bytes=None, memory_budget=None)
        lp = limit_budget(memory_limit() if limit is None else limit, non_expert=non_expert_bytes(mc, compute, stored_dtype(ckpt.storage_dtype, compute, device)),
                          minimal=minimal, user_sized=user_sized, offload=cfg.offload)
    plan = plan_offload(mc, **common, cache_experts=cfg.cache_experts, cache_bytes=cfg.cache_bytes,
                        memory_budget=cfg.memory_budget if lp is None or lp.budget is None else lp.budget)
    if lp is not None:
        user = [n for n, v in (("cache_experts", cfg.cache_experts), ("cache_bytes", cfg.cache_bytes),
                               ("memory_budget", cfg.memory_budget)) if v is not None]
        if lp.budget is not None:
            plan.memory_budget = None  # the limit's budget is reported under memory_limit, not as the user's
            unbound = plan_offload(mc, **common, cache_experts=None, cache_bytes=None, memory_budget=None)
        lp.sized_by = " + ".join(user) or ("memory limit" if plan.slots < unbound.slots else "default")
    return StorePlan(fmt, compute, dtype, expert_bytes, direct, io_depth, stride, plan, lp)


def build_store(ckpt: Checkpoint, cfg: OffloadConfig, *, dtype: torch.dtype, device: torch.device,
                draft_experts: int = 0, progress: bool = False, model=None, plan: StorePlan | None = None):
    """Returns (store, ExpertMemory plan). `dtype` is the compute dtype slots hold; experts stay in their
    storage format (`cfg.expert_format`: the checkpoint's dtype, or int8 / int4) in the tier and are decoded
    on arrival. `draft_experts` is SpecMoE's N (0 without speculation): its N experts per MoE layer stay pinned
    in the slots, which memory_budget / cache_bytes must hold. `model` (the loaded Transformer) gives predicted prefetch its
    routers and lets the static policy profile the model when the checkpoint ships no expert_profile.json.
    `plan`: plan_store's result for the same arguments, made before the weights were loaded (default: made now)."""
    device = torch.device(device)
    mc = ckpt.config
    sp = plan_store(ckpt, cfg, dtype=dtype, device=device, draft_experts=draft_experts) if plan is None else plan
    fmt, compute, dtype, expert_bytes, plan = sp.fmt, sp.compute, sp.dtype, sp.expert_bytes, sp.memory
    direct, io_depth, stride = sp.direct, sp.io_depth, sp.stride
    if cfg.offload == "none":
        reader = None
        if fmt.quantized:  # the resident experts are the quantized model's, decoded as a tier would
            from specmoe.experts.repack import open_repack
            rp = open_repack(ckpt, fmt, cfg.repack_dir, progress=progress)
            reader = lambda layer, e, out: fmt.load(rp.read(layer, e).to(out.device), out)  # noqa: E731
        return ResidentExperts(ckpt, dtype, device, progress=progress, reader=reader, fmt=fmt), plan
    from specmoe.experts.cache import ExpertCache
    from specmoe.experts.tiers import DiskTier, EmulatedLink, HostTier
    link = None
    if cfg.offload == "host":
        emulate = cfg.link_gbps is not None or cfg.link_latency_us is not None
        if emulate and device.type == "cuda":
            raise InputError("the emulated link is for CPU runs; on CUDA the real host-device link is used")
        reader = None
        if fmt.quantized:
            from specmoe.experts.repack import open_repack
            reader = open_repack(ckpt, fmt, cfg.repack_dir, progress=progress).read
        tier = HostTier(ckpt, dtype, pin=device.type == "cuda",
                        link=EmulatedLink(cfg.link_gbps, cfg.link_latency_us) if emulate else None,
                        progress=progress, fmt=fmt, reader=reader)
        if emulate:
            link = {"link_gbps": cfg.link_gbps, "link_latency_us": cfg.link_latency_us or 0.0}
    else:
        from specmoe.experts.repack import open_repack
        tier = DiskTier(open_repack(ckpt, fmt, cfg.repack_dir, progress=progress), dtype, direct=direct,
                        queue_depth=io_depth)
    assert tier.stride == stride, "plan and tier disagree on the slot size"
    cache = ExpertCache(tier, mc, slots=plan.slots, policy=cfg.cache_policy, prefetch=cfg.prefetch, device=device,
                        memory_budget=cfg.memory_budget, link=link, scratch_buffers=SCRATCH_BUFFERS,
                        memory_limit=sp.limit.to_dict() if sp.limit is not None else None)
    assert (cache.nbytes, cache.scratch_bytes, cache.staging_bytes) == (
        plan.parts["expert_cache_slots"], plan.parts["scratch"], plan.parts["staging"] - tier.staging_bytes), \
        "plan and cache disagree"
    if model is not None:
        cache.attach_model(model)
    if cfg.cache_policy == "static":
        cache.set_static(static_hot_set(ckpt, cfg, cache, model, dtype=compute, device=device))
    return cache, plan


def slot_dtype(fmt, compute: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype expert slots hold: the stored one where the native CPU kernels compute from it (bf16 / fp16 experts
    stay bf16 / fp16 everywhere; int8 / int4 slots hold the format's own bytes, `STORED`: no compute-dtype copy,
    budgets count stored bytes); else the compute dtype (decoded on arrival)."""
    if device.type == "cpu" and fmt.native_stored and native.available():
        return STORED
    if isinstance(fmt, Plain) and fmt.dtype in (torch.bfloat16, torch.float16) and fmt.dtype != compute \
            and device.type == "cpu" and native.available():
        return fmt.dtype
    return compute


def static_hot_set(ckpt: Checkpoint, cfg: OffloadConfig, cache, model, *, dtype, device) -> dict[int, list[int]]:
    """The hottest ~10% experts per layer: from <checkpoint>/expert_profile.json, else from a cached profile,
    else from a short profiling run (cached next to the repack for the next start)."""
    from specmoe.experts import profiling
    from specmoe.experts.repack import candidate_dirs, checkpoint_key, writable
    mc = ckpt.config
    shipped = ckpt.path / "expert_profile.json"
    # keyed like the repack files: a repack_dir shared by several checkpoints holds one profile each
    cached = [d / f"expert_profile-{checkpoint_key(ckpt)}.json" for d in candidate_dirs(ckpt, cfg.repack_dir)]
    if shipped.is_file():
        return profiling.hot_experts(profiling.load_profile(shipped, mc), mc)
    for p in cached:  # an auto profile counts only for the weights it was made from
        if p.is_file() and profiling.profile_fingerprint(p) == ckpt.fingerprint():
            return profiling.hot_experts(profiling.load_profile(p, mc), mc)
    if model is None:
        raise InputError("cache_policy='static' needs an expert profile: add expert_profile.json to the checkpoint "
                         "(`specmoe profile`) or build the store with the model so it can profile itself")
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
