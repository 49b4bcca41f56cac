"""What expert memory a configuration holds, part by part, checked against memory_budget / cache_bytes
before anything is allocated.

Parts (bytes): `resident_experts` (offload none), `expert_cache_slots` (slots × slot bytes × MoE
layers), `scratch` (the cache's spare buffers for a union larger than a layer's slots), `staging`
(CUDA + disk: pinned host buffers a read lands in before its device copy), `host_tier` (offload host:
every expert in host RAM). SpecMoE's draft owns no expert memory: its N experts per MoE layer are
pinned in the cache's slots and read in place, so with a draft the slots per layer are at least N
(by default N + top-k, so the target's misses still find room).

`memory_budget` bounds the sum of all parts; `cache_bytes` bounds the device working set (slots,
scratch, staging). Either sets the slots per layer from what is left.

Without either (and without cache_experts), an offloaded model on the CPU is sized from the memory limit the
process runs under (`limit_budget`: its cgroup's memory.limit_in_bytes / memory.max, or MemAvailable, whichever
leaves less, after the non-expert weights and a headroom): the default slots, or fewer where the limit leaves
less. A limit that cannot hold the non-expert weights, the minimal cache (top-k slots per layer, or the draft's
N, + scratch) and the headroom is refused before any weight is loaded.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specmoe.config import ModelConfig
from specmoe.errors import InputError, MemoryBudgetError
from specmoe.memory import MemoryLimit
from specmoe.weights.names import fp32_params, non_expert_keys

SCRATCH_BUFFERS = 2  # double buffering: one spare expert computes while the next loads
STAGING_BUFFERS = 4  # CUDA + disk tier

PARTS = ("resident_experts", "expert_cache_slots", "scratch", "staging", "host_tier")
# parts that `cache_bytes` bounds (the device working set of the offloader)
WORKING_SET = ("expert_cache_slots", "scratch", "staging")


# left free under a memory limit for what is not weights or experts (KV cache, activations, the allocator's slack)
HEADROOM_SHARE = 0.10  # of the room the limit leaves
HEADROOM_MIN = 256 * 2**20


class BudgetTooSmallError(MemoryBudgetError, InputError):
    """memory_budget / cache_bytes cannot hold the minimum (top-k or N draft slots + scratch ...)."""


class MemoryLimitError(BudgetTooSmallError):
    """The memory limit the process runs under (cgroup, MemAvailable) cannot hold the non-expert weights, the
    minimal expert cache and the headroom."""


def headroom(room: int) -> int:
    return max(HEADROOM_MIN, int(room * HEADROOM_SHARE))


def non_expert_bytes(mc: ModelConfig, dtype: torch.dtype, stored: torch.dtype | None = None) -> int:
    """An upper bound of the non-expert weights' bytes once loaded in `dtype`, from the checkpoint's shapes, before
    anything is loaded: every tensor at `dtype`'s size (fp32 routers at 4 bytes), plus, where the loader keeps
    projections in a `stored` dtype (models.loader.stored_dtype), a stored copy of a tied embedding for the LM head
    (the projections themselves then take less than counted). llm.stats['memory']['non_expert_weights'] is the
    measured figure."""
    fp32 = fp32_params(mc)
    size = torch.empty(0, dtype=dtype).element_size()
    n = sum(math.prod(shape) * (4 if name in fp32 else size) for name, (_, shape) in non_expert_keys(mc).items())
    if stored is not None and mc.tie_word_embeddings and mc.seq2seq is None:
        n += mc.vocab_size * mc.hidden_size * torch.empty(0, dtype=stored).element_size()
    return n


@dataclass
class LimitPlan:
    """What the memory limit leaves for the experts: `budget` bounds every expert part (None: the user sized the
    cache)."""
    limit: MemoryLimit
    non_expert_bytes: int
    headroom: int
    minimal_cache_bytes: int
    budget: int | None
    sized_by: str = ""  # what set the slots per layer: cache_experts, cache_bytes, memory_budget, default, limit

    def to_dict(self) -> dict:
        return {**self.limit.to_dict(), "non_expert_bytes_estimate": self.non_expert_bytes,
                "headroom_bytes": self.headroom, "minimal_expert_bytes": self.minimal_cache_bytes,
                "limit_expert_budget": self.budget, "cache_sized_by": self.sized_by}


def limit_budget(limit: MemoryLimit, *, non_expert: int, minimal: ExpertMemory, user_sized: bool,
                 offload: str = "disk") -> LimitPlan:
    """The expert budget `limit` leaves after the non-expert weights and the headroom (None when `user_sized`:
    cache_experts / cache_bytes / memory_budget decide then). Raises MemoryLimitError, with the numbers, when the
    limit cannot hold the non-expert weights + `minimal` (the smallest cache that runs) + the headroom."""
    room = limit.room
    head = headroom(room)
    need = non_expert + minimal.total + head
    if need > room:
        raise MemoryLimitError(
            f"memory limit too small: {limit.describe()} leaves {mib(room)}, less than non-expert weights "
            f"{mib(non_expert)} + minimal expert cache {mib(minimal.total)} ({minimal.slots} slots per layer: "
            f"{minimal.describe()}) + headroom {mib(head)} = {mib(need)}; raise the limit"
            + (", or offload='disk' (the host tier holds every expert in RAM)" if offload == "host" else "")
            + ", or use a smaller expert_format (int8/int4)")
    return LimitPlan(limit, non_expert, head, minimal.total, None if user_sized else room - non_expert - head)


def mib(n: int) -> str:
    x = n / 2**20
    return f"{x:.2f} MiB" if x >= 0.01 or x == 0 else f"{x:.2g} MiB"


@dataclass
class ExpertMemory:
    """The plan: slots per MoE layer and the bytes of each part."""
    slots: int
    parts: dict[str, int]
    memory_budget: int | None = None
    cache_bytes: int | None = None

    @property
    def total(self) -> int:
        return sum(self.parts.values())

    def describe(self) -> str:
        """'expert cache slots 1.69 MiB + scratch 0.28 MiB + ...' (non-zero parts)."""
        return " + ".join(f"{k.replace('_', ' ')} {mib(v)}" for k, v in self.parts.items() if v)


def plan_resident(mc: ModelConfig, *, expert_bytes: int, draft_experts: int,
                  memory_budget: int | None) -> ExpertMemory:
    parts = {**dict.fromkeys(PARTS, 0), "resident_experts": mc.num_experts * len(mc.moe_layers) * expert_bytes}
    plan = ExpertMemory(slots=0, parts=parts, memory_budget=memory_budget)
    if memory_budget is not None and plan.total > memory_budget:
        raise BudgetTooSmallError(f"memory_budget={mib(memory_budget)} is too small: {plan.describe()} = "
                                  f"{mib(plan.total)}; raise memory_budget, offload the experts (offload='host'/"
                                  "'disk')")
    return plan


def plan_offload(mc: ModelConfig, *, offload: str, slot_bytes: int, expert_bytes: int, cuda: bool,
                 draft_experts: int, cache_experts: int | None, cache_bytes: int | None,
                 memory_budget: int | None, stored_bytes: int | None = None,
                 staging: bool | None = None, tier_staging: int = 0) -> ExpertMemory:
    """Slots per layer from cache_experts, cache_bytes or memory_budget (default: E/4, at least top-k), and
    every part; raises when a limit cannot hold top-k slots and the fixed parts, or is exceeded.
    `stored_bytes`: one expert in the tier's storage format (default: expert_bytes, the compute dtype's);
    `staging`: whether pinned staging rows exist (default: CUDA + disk); `tier_staging`: bytes of the
    tier's own staging rows (CPU disk reads), counted under staging too."""
    stored_bytes = expert_bytes if stored_bytes is None else stored_bytes
    staging = cuda and offload == "disk" if staging is None else staging
    if cache_experts is not None and cache_bytes is not None:
        raise InputError("set cache_experts or cache_bytes, not both")
    L, E, K = len(mc.moe_layers), mc.num_experts, mc.top_k
    per_slot = slot_bytes * L

    def parts_for(slots: int) -> dict[str, int]:
        return {"resident_experts": 0, "expert_cache_slots": slots * per_slot,
                "scratch": SCRATCH_BUFFERS * slot_bytes if slots < E else 0,
                "staging": (STAGING_BUFFERS * slot_bytes if staging else 0) + tier_staging,
                "host_tier": E * L * stored_bytes if offload == "host" else 0}

    fixed = parts_for(0)  # everything but the slots (scratch counted: a cache smaller than E needs it)
    N = min(draft_experts, E)  # SpecMoE's draft set, pinned in the slots
    default = max(K, math.ceil(E / 4), min(E, N + K) if N else 0)
    limits = []  # (name, bytes, parts it bounds)
    if cache_bytes is not None:
        limits.append(("cache_bytes", cache_bytes, WORKING_SET))
    if memory_budget is not None:
        limits.append(("memory_budget", memory_budget, tuple(fixed)))
    if cache_experts is not None:
        slots = cache_experts
    else:
        slots = default if cache_bytes is None else E
        for name, limit, keys in limits:
            left = limit - sum(fixed[k] for k in keys if k != "expert_cache_slots")
            slots = min(slots, max(0, left) // per_slot)
    slots = min(slots, E)
    plan = ExpertMemory(slots=slots, parts=parts_for(slots), memory_budget=memory_budget, cache_bytes=cache_bytes)
    for name, limit, keys in limits:  # a limit that squeezed the slots below top-k fails here too
        low = max(slots, K, N)
        need = {k: v for k, v in parts_for(low).items() if k in keys}
        if sum(need.values()) > limit:
            shown = ExpertMemory(low, need)
            raise BudgetTooSmallError(
                f"{name}={mib(limit)} is too small: {low} slots per layer (top-k is {K}"
                + (f", {N} draft experts stay pinned" if N else "") + ") need "
                f"{shown.describe()} = {mib(shown.total)}; raise {name}"
                + (" or lower draft_experts" if draft_experts else "")
                + (" or lower cache_experts" if cache_experts is not None and cache_experts > K else ""))
    if slots < K:
        raise InputError(f"the expert cache holds {slots} expert(s) per MoE layer, fewer than the {K} (top-k) "
                         f"a single token needs; raise cache_experts (or cache_bytes) to at least {K}")
    return plan
