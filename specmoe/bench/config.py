"""Benchmark configuration and its presets."""
from __future__ import annotations

from dataclasses import dataclass, field, replace


@dataclass
class BenchConfig:
    model: str | None = None            # checkpoint dir (None: the bundled demo model)
    out: str = "benchmarks/results"
    preset: str = "custom"
    dtype: str = "auto"
    device: str = "cpu"                 # compute device of every specmoe system ("cuda" on a GPU machine)
    tiers: tuple[str, ...] = ("disk", "host")  # "disk" is the headline; "host" runs behind an emulated link
    systems: tuple[str, ...] | None = None     # None: every registered system
    tier_systems: dict | None = None           # per-tier override of `systems`, e.g. {"host": ("ondemand", ...)}
    batch_sizes: tuple[int, ...] = (1, 4, 16)
    max_tokens: int = 16                # generated per sequence (EOS ignored)
    prompt_tokens: int = 48             # prompts truncated to this many tokens
    prompts_dir: str | None = None      # default: the bundled prompts (specmoe/bundled.py)
    cache_fraction: float = 0.25        # expert cache per MoE layer, as a share of its experts
    link_gbps: float | None = 16.0      # emulated link of the host tier (None: the build's default)
    link_latency_us: float | None = 10.0
    sweep_batch: int | str = 16         # batch of the γ / N / policy / substitution sweeps; "best": the main
                                        # sweep's batch where SpecMoE gains most over MoE-OnDemand
    sweep_tier: str = "disk"
    sweep_max_tokens: int | None = None  # None: max_tokens (τ counts only tokens within max_tokens: keep it ≫ γ)
    gammas: tuple[int, ...] = (1, 2, 4, 8)
    draft_experts: tuple[int, ...] = (2, 4, 8)
    policies: bool = True
    substitutions: bool = True
    peers: tuple[str, ...] = ("hf", "hf-offload", "llama.cpp")
    peer_batches: tuple[int, ...] = (1, 16)
    peer_max_tokens: int | None = None  # default: max_tokens
    widened: bool = False               # also run the main sweep on the widened copy of the model
    widened_batches: tuple[int, ...] = (1, 4, 16)
    widened_systems: tuple[str, ...] | None = None  # None: the main sweep's systems
    widened_tiers: tuple[str, ...] | None = None    # None: the main sweep's tiers
    widened_max_tokens: int | None = None           # None: max_tokens
    widened_hidden: int | None = None   # default: 4x the model's hidden size
    widened_expert_mb: float = 6.0
    cache_dir: str | None = None        # built artefacts (widened model, GGUF); default ~/.cache/specmoe
    llama_cpp_src: str | None = None    # llama-cpp-python sdist (.tar.gz or dir) holding convert_hf_to_gguf.py
    threads: int | None = 1            # torch threads; 1 by default: on a shared, oversubscribed machine
                                        # 2 OpenMP threads spin-wait and run 30x slower (measured)
    time_budget_s: float | None = None  # no new measurement starts past this (they are marked skipped)
    peer_reserve_s: float = 150.0       # share of the budget kept for the peers, which run last
    progress: bool = True
    repeats: int = 1                    # measured runs per point; the fastest is reported, all walls kept
    repeat_below_tokens: int = 1024     # repeat only points generating at most this many tokens
    instrument: bool = True             # time fetch vs expert compute by wrapping the store
    plots: bool = True
    extra_options: dict = field(default_factory=dict)  # passed to every offloaded LLM


PRESETS = {
    # ≤3 min on a 2-core machine with the demo model
    "quick": dict(tiers=("disk", "host"), batch_sizes=(1, 16), max_tokens=12, prompt_tokens=32, sweep_batch=8,
                  sweep_max_tokens=16,
                  gammas=(2, 4), draft_experts=(2, 8), peers=("hf",), peer_batches=(1, 16), peer_max_tokens=8,
                  systems=("resident", "ondemand", "static", "lru", "overlap", "specmoe"), time_budget_s=170,
                  peer_reserve_s=25),
    # what the README's Results block is generated from (`make bench`): the demo model on the disk tier, every
    # headline baseline at batch 1-256, the peers, the widened copy at batch 1-64; no sweeps. ≤25 min on a
    # 2-core machine (its time budget marks later points skipped rather than run over)
    "headline": dict(tiers=("disk",), batch_sizes=(1, 4, 16, 64, 128, 256), max_tokens=16, prompt_tokens=32,
                     systems=("resident", "ondemand", "static", "lru", "overlap", "specmoe", "auto"),
                     sweep_batch=16, gammas=(), draft_experts=(), policies=False, substitutions=False,
                     peers=("hf", "hf-offload", "llama.cpp"), peer_batches=(1, 16), peer_max_tokens=16,
                     widened=True, widened_batches=(1, 4, 16, 64), widened_tiers=("disk",),
                     widened_systems=("resident", "ondemand", "lru", "specmoe"),
                     repeats=2, time_budget_s=24 * 60, peer_reserve_s=150),
    # ≤30 min
    "full": dict(tiers=("disk", "host"), batch_sizes=(1, 4, 16, 64, 128, 256), max_tokens=16, prompt_tokens=32,
                 tier_systems={"host": ("resident", "ondemand", "lru", "overlap", "specmoe")},
                 sweep_batch=32, sweep_max_tokens=32, gammas=(1, 2, 4, 6, 8, 10), draft_experts=(1, 2, 4, 8, 16),
                 peers=("hf", "hf-offload", "llama.cpp"), peer_batches=(1, 16), peer_max_tokens=16,
                 widened=True, widened_batches=(1, 4, 16, 64), widened_tiers=("disk",),
                 widened_systems=("resident", "ondemand", "static", "lru", "overlap", "specmoe", "eagle"),
                 repeats=2, time_budget_s=28 * 60),
}


def preset(name: str, **overrides) -> BenchConfig:
    if name not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known: {', '.join(PRESETS)}")
    cfg = replace(BenchConfig(), preset=name, **PRESETS[name])
    return replace(cfg, **{k: v for k, v in overrides.items() if v is not None})
