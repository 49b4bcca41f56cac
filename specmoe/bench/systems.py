"""The systems the benchmark compares, registered in one place, and run-time discovery
of which of them this build can run.

A system is a name plus the `LLM(**options)` it needs beyond the shared setting of a
sweep (tier, cache size, link). Nothing here is hard-wired to a particular build: the
fields of `OffloadConfig` / `SpecConfig` and their `choices` metadata decide whether a
system is available, and a system that is not gets a reason instead of a number.
"""
from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields

from specmoe.options import OffloadConfig, SpecConfig


@dataclass(frozen=True)
class System:
    name: str
    label: str      # as in the SpecMoE paper's figures where the system comes from there
    options: dict   # LLM options on top of the sweep's tier / cache size
    kind: str = "baseline"  # "reference" | "baseline" | "speculative"
    note: str = ""


# The one registry. Later strategies (tree speculation, SpecFit, EcoSpec, ...) add a line here.
SYSTEMS: tuple[System, ...] = (
    System("resident", "All experts resident", {"offload": "none", "decoding": "ar"}, kind="reference",
           note="upper bound: no expert ever moves; the greedy-token reference for every other system"),
    System("ondemand", "MoE-OnDemand", {"cache_policy": "ondemand", "prefetch": "none", "decoding": "ar"},
           note="fetch the union of needed experts per layer, no cache beyond the layer"),
    System("static", "MoE-Caching", {"cache_policy": "static", "prefetch": "none", "decoding": "ar"},
           note="hottest experts per layer (profiled) pinned, the rest on demand"),
    System("lru", "LRU cache", {"cache_policy": "lru", "prefetch": "none", "decoding": "ar"}),
    System("lfu", "LFU cache", {"cache_policy": "lfu", "prefetch": "none", "decoding": "ar"}),
    System("overlap", "MoE-Overlap (oracle)", {"cache_policy": "ondemand", "prefetch": "oracle", "decoding": "ar"},
           note="next layer's experts transferred while the current layer computes (oracle: upper bound)"),
    System("overlap-predicted", "MoE-Overlap (predicted)",
           {"cache_policy": "ondemand", "prefetch": "predicted", "decoding": "ar"}),
    System("specmoe", "SpecMoE", {"decoding": "specmoe"}, kind="speculative",
           note="self-assisted speculation: draft = target restricted to N resident draft experts"),
    System("specmoe-prefetch", "SpecMoE + draft-guided prefetch", {"decoding": "specmoe", "draft_prefetch": True},
           kind="speculative", note="while drafting, the target routers' picks for drafted tokens load in the background"),
    System("auto", "SpecMoE (auto fallback)", {"decoding": "auto"}, kind="speculative",
           note="speculates only where the cost model predicts a gain"),
    System("ngram", "n-gram drafts + LRU", {"cache_policy": "lru", "prefetch": "none", "decoding": "specmoe",
                                           "drafter": "ngram"}, kind="speculative",
           note="prompt/output lookup drafts (no draft compute, no draft-set slots) verified over the LRU cache"),
    System("ngram-cost", "n-gram drafts, cost-aware length + LRU",
           {"cache_policy": "lru", "prefetch": "none", "decoding": "specmoe", "drafter": "ngram",
            "draft_selection": "cost"}, kind="speculative",
           note="verifies the prefix of each proposal that maximises predicted tokens/s (selection.py)"),
    System("ngram-tree", "n-gram token trees + LRU",
           {"cache_policy": "lru", "prefetch": "none", "decoding": "specmoe", "drafter": "ngram", "draft_tree": True},
           kind="speculative", note="several history continuations merged into a trie, verified in one forward"),
    System("ngram-tree-cost", "n-gram token trees, cost-aware subtree + LRU",
           {"cache_policy": "lru", "prefetch": "none", "decoding": "specmoe", "drafter": "ngram", "draft_tree": True,
            "draft_selection": "cost"}, kind="speculative",
           note="verifies the ancestor-closed subtree that maximises predicted tokens/s (treeselect.py)"),
    System("eagle", "EAGLE head drafts + LRU", {"cache_policy": "lru", "prefetch": "none", "decoding": "specmoe",
                                               "drafter": "eagle"}, kind="speculative",
           note="a one-layer dense head over the target's last hidden state drafts (no expert bytes); the demo "
                "model's head ships (widened with it into its widened copy), other models need eagle_head=PATH"),
    System("eagle-tree", "EAGLE head token trees + LRU",
           {"cache_policy": "lru", "prefetch": "none", "decoding": "specmoe", "drafter": "eagle", "draft_tree": True},
           kind="speculative", note="the EAGLE head's chain verified through the tree decoder"),
    System("specmoe-tree", "SpecMoE token trees", {"decoding": "specmoe", "draft_tree": True}, kind="speculative",
           note="the self draft's chain + its next most likely tokens per depth as leaves, one verification"),
    System("specmoe-tree-cost", "SpecMoE token trees, cost-aware subtree",
           {"decoding": "specmoe", "draft_tree": True, "draft_selection": "cost"}, kind="speculative",
           note="self-draft trees, verifying the subtree that maximises predicted tokens/s"),
)

OFFLOADED_BASELINE = "ondemand"  # what speedups are quoted against first
HEADLINE = "specmoe"


def system(name: str) -> System:
    for s in SYSTEMS:
        if s.name == name:
            return s
    raise KeyError(f"unknown system {name!r}; known: {', '.join(s.name for s in SYSTEMS)}")


def option_fields() -> dict:
    """{option name: dataclasses.Field} over OffloadConfig and SpecConfig of this build."""
    return {f.name: f for cls in (OffloadConfig, SpecConfig) for f in fields(cls)}


def has_option(name: str) -> bool:
    return name in option_fields()


def choices(name: str) -> tuple | None:
    """The `choices` metadata of an option (None: free-valued or absent)."""
    f = option_fields().get(name)
    return None if f is None else f.metadata.get("choices")


def default(name: str):
    f = option_fields().get(name)
    if f is None:
        return None
    if f.default is not MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not MISSING else None


def unavailable_reason(options: dict) -> str | None:
    """None if every option exists in this build with an allowed value, else why not."""
    known = option_fields()
    for k, v in options.items():
        if k not in known:
            return f"option {k}= not available in this build"
        c = known[k].metadata.get("choices")
        if c is not None and v not in c:
            return f"{k}={v!r} not available in this build (choices: {', '.join(map(str, c))})"
    return None


@dataclass
class Setting:
    """The shared part of a sweep point: backing tier, cache size, emulated link."""
    tier: str                       # "none" | "disk" | "host"
    cache_experts: int | None = None  # per MoE layer
    link_gbps: float | None = None    # host tier only: emulated link (None: the real link, e.g. PCIe on CUDA)
    link_latency_us: float | None = None
    extra: dict = field(default_factory=dict)

    @property
    def emulated(self) -> bool:
        return self.tier == "host" and (self.link_gbps is not None or self.link_latency_us is not None)

    @property
    def name(self) -> str:
        return "host (emulated link)" if self.emulated else ("host RAM" if self.tier == "host" else self.tier)


def tier_options(setting: Setting, *, expert_bytes: int, num_moe_layers: int) -> dict:
    """LLM options for a tier; the cache size is given in whatever unit this build accepts."""
    opts = {"offload": setting.tier}
    if setting.tier == "none":
        return opts
    if setting.cache_experts is not None:
        if has_option("cache_experts"):
            opts["cache_experts"] = setting.cache_experts
        elif has_option("cache_bytes"):
            opts["cache_bytes"] = setting.cache_experts * expert_bytes * num_moe_layers
    if setting.emulated:
        if setting.link_gbps is not None:
            opts["link_gbps"] = setting.link_gbps
        if setting.link_latency_us is not None:
            opts["link_latency_us"] = setting.link_latency_us
    opts.update(setting.extra)
    return opts


def system_options(sys_: System, setting: Setting, *, expert_bytes: int, num_moe_layers: int,
                   overrides: dict | None = None) -> dict:
    """Full LLM options of a system at a sweep point. The reference system ignores the tier."""
    if sys_.kind == "reference":
        opts = dict(sys_.options)
    else:
        opts = tier_options(setting, expert_bytes=expert_bytes, num_moe_layers=num_moe_layers)
        opts.update(sys_.options)
    opts.update(overrides or {})
    # Options the build does not know but whose value is the implicit behaviour are dropped
    # (e.g. prefetch="none" on a build without prefetch; decoding="ar" is always there).
    implicit = {"prefetch": "none", "decoding": "ar"}
    return {k: v for k, v in opts.items() if not (k in implicit and v == implicit[k] and not has_option(k))}


def availability(sys_: System, setting: Setting, *, expert_bytes: int, num_moe_layers: int) -> str | None:
    return unavailable_reason(system_options(sys_, setting, expert_bytes=expert_bytes,
                                             num_moe_layers=num_moe_layers))
