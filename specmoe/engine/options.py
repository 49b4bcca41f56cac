"""Runtime knobs as small frozen dataclasses. `LLM(**kwargs)` and the CLI are generated
from these fields (each field's `help` metadata becomes the flag's help text)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields

from specmoe.experts.memory import parse_size


def opt(default, help: str, choices: tuple | None = None, type=None):
    """A config field; `type` is the CLI parser for fields whose default (None) does not tell it."""
    return field(default=default, metadata={"help": help, "choices": choices, "type": type})


@dataclass(frozen=True)
class OffloadConfig:
    """Where experts live and how the bounded device expert cache behaves (see specmoe/experts)."""
    offload: str = opt("none", "backing tier of expert weights: none (all resident), host RAM, or disk (SSD, "
                       "direct reads of a one-time aligned repack)", ("none", "host", "disk"))
    cache_experts: int | None = opt(None, "device cache slots per MoE layer (default: a quarter of the experts, "
                                    "at least top-k)", type=int)
    cache_bytes: int | None = opt(None, "upper bound on the device expert working set over all MoE layers, e.g. "
                                  "2GiB: cache slots + scratch rows + staging + SpecMoE's draft copy (sets the "
                                  "slots per layer from what is left; instead of cache_experts)", type=parse_size)
    cache_policy: str = opt("lru", "expert cache policy: ondemand (nothing kept past a layer), static (hottest "
                            "~10%% per layer from a profile stay), lru, lfu", ("ondemand", "static", "lru", "lfu"))
    prefetch: str = opt("none", "fetch layer l+1's experts while layer l computes: predicted (next router on the "
                        "current hidden state) or oracle (replay of a recorded run; an upper bound)",
                        ("none", "oracle", "predicted"))
    link_gbps: float | None = opt(None, "host tier only: emulate a host-device link of this bandwidth in GB/s "
                                  "(10^9 bytes/s); outputs are labelled emulated_link", type=float)
    link_latency_us: float | None = opt(None, "host tier only: emulated per-transfer latency in microseconds",
                                        type=float)
    memory_budget: int | None = opt(None, "upper bound on all expert memory, e.g. 8GiB: resident experts, or "
                                    "cache slots + scratch + staging + host tier, + SpecMoE's draft copy (not the "
                                    "KV cache or the non-expert weights); too small is an error at construction; "
                                    "llm.stats['memory'] shows each part", type=parse_size)
    repack_dir: str | None = opt(None, "disk tier: directory of the aligned expert repack (default: "
                                 "<checkpoint>/.specmoe, else ~/.cache/specmoe/<hash>)", type=str)

    def __post_init__(self):
        from specmoe.errors import InputError
        for name in ("cache_bytes", "memory_budget"):  # LLM(cache_bytes="2GiB") as well as ints
            object.__setattr__(self, name, parse_size(getattr(self, name)))
        for f in fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise InputError(f"{f.name}={getattr(self, f.name)!r}; choose one of {', '.join(choices)}")
        if self.cache_experts is not None and self.cache_experts < 1:
            raise InputError(f"cache_experts must be >= 1, got {self.cache_experts}")
        if self.offload != "host" and (self.link_gbps is not None or self.link_latency_us is not None):
            raise InputError("link_gbps / link_latency_us emulate the host-device link: they need offload='host'")
        if self.link_gbps is not None and self.link_gbps <= 0:
            raise InputError(f"link_gbps must be positive, got {self.link_gbps}")


@dataclass(frozen=True)
class SpecConfig:
    """Decoding strategy and speculative-decoding knobs (see specmoe/decoding)."""
    decoding: str = opt("ar", "decoding strategy: plain autoregressive, SpecMoE self-assisted speculation, or "
                        "auto (a cost model picks SpecMoE or AR per batch from measured timings)",
                        ("ar", "specmoe", "auto"))
    draft_experts: int = opt(4, "SpecMoE: resident draft experts N per MoE layer (the draft uses only these)")
    num_draft_tokens: int = opt(4, "SpecMoE: tokens drafted per step (gamma)")
    substitution: str = opt("affinity", "SpecMoE: how the draft replaces a routed non-draft expert: nearest draft "
                            "expert by weight distance (affinity), top-k among draft experts by router score "
                            "(mask), or a random draft expert (random, ablation)", ("affinity", "mask", "random"))
    draft_policy: str = opt("hot-temporal", "SpecMoE: draft-set policy: top-N experts of the last verification "
                            "(hot-temporal), static from a profile (hot-global), or random (ablation)",
                            ("hot-temporal", "hot-global", "random"))
    seed: int = opt(0, "SpecMoE: seed of the random substitution / random draft-set modes")

    def __post_init__(self):
        from specmoe.errors import InputError
        if self.draft_experts < 1:
            raise InputError(f"draft_experts must be >= 1, got {self.draft_experts}")
        if self.num_draft_tokens < 1:
            raise InputError(f"num_draft_tokens must be >= 1, got {self.num_draft_tokens}")
        for f in fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise InputError(f"{f.name}={getattr(self, f.name)!r}; choose one of {', '.join(choices)}")


def split_options(kwargs: dict) -> tuple[OffloadConfig, SpecConfig]:
    """Route LLM(**kwargs) keywords to the config that owns them; unknown names are an error."""
    from specmoe.errors import InputError
    groups = {}
    for cls in (OffloadConfig, SpecConfig):
        names = {f.name for f in fields(cls)}
        groups[cls] = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
    if kwargs:
        raise InputError(f"unknown option(s): {', '.join(sorted(kwargs))}")
    return OffloadConfig(**groups[OffloadConfig]), SpecConfig(**groups[SpecConfig])
