"""Runtime knobs as small frozen dataclasses. `LLM(**kwargs)` and the CLI are generated
from these fields (each field's `help` metadata becomes the flag's help text)."""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field, fields

import torch

from specmoe.errors import InputError
from specmoe.memory import SizeError, parse_size

MAX_DRAFT_TOKENS = 64  # gamma: KV positions reserved past every sequence; beyond this it only costs memory
SEED_RANGE = (-2**63, 2**64 - 1)  # what torch.Generator.manual_seed takes


def check_int(name: str, v, lo: int = 1, hi: int | None = None, *, none_ok: bool = False) -> None:
    """An integer option (bools and floats are not integers) in [lo, hi]."""
    if v is None and none_ok:
        return
    if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise InputError(f"{name} must be an integer {rng}, got {v!r}")


def check_number(name: str, v, *, lo: float = 0.0, lo_open: bool = True, hi: float | None = None,
                 none_ok: bool = False) -> None:
    """A finite real option above lo (strictly when lo_open) and at most hi."""
    if v is None and none_ok:
        return
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    if not ok or (v <= lo if lo_open else v < lo) or (hi is not None and v > hi):
        rng = f"{'>' if lo_open else '>='} {lo:g}" + (f" and <= {hi:g}" if hi is not None else "")
        raise InputError(f"{name} must be a finite number {rng}, got {v!r}")


def size(value) -> int | None:
    """A positive byte size: 4096, 2.5e9, '512MiB' (None stays None). The CLI's type for size flags,
    so a bad value is a SizeError (an InputError and a ValueError: argparse reports it as a bad value)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise SizeError(f"a byte size must be an integer or a string like '2GiB', got {type(value).__name__}")
    if isinstance(value, float) and not math.isfinite(value):
        raise SizeError(f"byte size {value!r} is not finite")
    try:
        n = parse_size(value)
    except (OverflowError, ValueError):  # float('1e999') is inf; int(inf) overflows
        raise SizeError(f"cannot read {value!r} as a finite byte size (examples: 4096, 512MiB, 2GB)") from None
    if n <= 0:
        raise SizeError(f"byte size {value!r} must be positive")
    return n


def resolve_device(device) -> torch.device:
    """cpu, cuda or cuda:N that exists on this machine."""
    if isinstance(device, torch.device):
        d = device
    elif isinstance(device, str):
        try:
            d = torch.device(device)
        except RuntimeError:
            raise InputError(f"device={device!r} is not a device name; use cpu, cuda or cuda:N") from None
    else:
        raise InputError(f"device must be a string like 'cpu' or 'cuda:0', got {type(device).__name__}")
    if d.type == "cpu":
        return d
    if d.type != "cuda":
        raise InputError(f"device={device!r} is not supported; use cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise InputError(f"device={device!r} requested but CUDA is not available")
    if d.index is not None and d.index >= torch.cuda.device_count():
        raise InputError(f"device={device!r} does not exist: this machine has {torch.cuda.device_count()} "
                         "CUDA device(s)")
    return d


def check_llm_args(*, model, max_batch, max_model_len, progress, threads) -> None:
    """LLM(...) keywords other than dtype/device (resolve_dtype / resolve_device) and the option dataclasses."""
    if model is not None and (not isinstance(model, (str, os.PathLike)) or not str(model) or "\0" in str(model)):
        raise InputError(f"model must be a checkpoint directory path or None, got {model!r}")
    check_int("max_batch", max_batch, 1)
    check_int("max_model_len", max_model_len, 2, none_ok=True)
    check_int("threads", threads, 1, 4096, none_ok=True)
    if not isinstance(progress, bool):
        raise InputError(f"progress must be True or False, got {progress!r}")


def opt(default, help: str, choices: tuple | None = None, type=None):
    """A config field; `type` is the CLI parser for fields whose default (None) does not tell it."""
    return field(default=default, metadata={"help": help, "choices": choices, "type": type})


@dataclass(frozen=True)
class OffloadConfig:
    """Where experts live and how the bounded device expert cache behaves (see specmoe/experts)."""
    offload: str = opt("none", "backing tier of expert weights: none (all resident), host RAM, or disk (SSD, "
                       "direct reads of a one-time aligned repack)", ("none", "host", "disk"))
    cache_experts: int | None = opt(None, "device cache slots per MoE layer (default: a quarter of the experts, "
                                    "at least top-k; with speculation at least draft_experts + top-k; on the CPU "
                                    "fewer where the memory limit (cgroup memory.limit_in_bytes / memory.max, or "
                                    "MemAvailable) leaves less after the non-expert weights: docs/offloading.md)",
                                    type=int)
    cache_bytes: int | None = opt(None, "upper bound on the device expert working set over all MoE layers, e.g. "
                                  "2GiB: cache slots (SpecMoE's draft experts are pinned in them) + scratch rows + "
                                  "staging (sets the "
                                  "slots per layer from what is left; instead of cache_experts)", type=size)
    cache_policy: str | None = opt(None, "expert cache policy: ondemand (nothing kept past a layer), static "
                                   "(hottest ~10%% per layer from a profile stay), lru, lfu, adaptive (per layer, "
                                   "LRU's or LFU's eviction, whichever a simulation of both over the recent requests "
                                   "would have hit more), s3fifo (scan-resistant: new experts pass a small FIFO, "
                                   "re-used ones live in a main FIFO with a 2-bit access count, a ghost of recent "
                                   "evictions re-admits to main); default: s3fifo on the disk tier (it hit most on "
                                   "natural text, benchmarks/results/cache_policy.json), adaptive otherwise",
                                   ("ondemand", "static", "lru", "lfu", "adaptive", "s3fifo"), type=str)
    prefetch: str = opt("none", "fetch layer l+1's experts while layer l computes: predicted (next router on the "
                        "current hidden state) or oracle (replay of a recorded run; an upper bound)",
                        ("none", "oracle", "predicted"))
    link_gbps: float | None = opt(None, "host tier only: emulate a host-device link of this bandwidth in GB/s "
                                  "(10^9 bytes/s); outputs are labelled emulated_link", type=float)
    link_latency_us: float | None = opt(None, "host tier only: emulated per-transfer latency in microseconds",
                                        type=float)
    memory_budget: int | None = opt(None, "upper bound on all expert memory, e.g. 8GiB: resident experts, or "
                                    "cache slots + scratch + staging + host tier (not the "
                                    "KV cache or the non-expert weights); too small is an error at construction; "
                                    "llm.stats['memory'] shows each part", type=size)
    expert_format: str = opt("checkpoint", "storage format of the offloaded experts: the checkpoint's own "
                             "dtype, or int8 (per output channel) / int4 (groups of 32; int4-g64: of 64) made once "
                             "by `specmoe quantize` (or on first use) into the repack; experts move in these "
                             "bytes and are dequantised into the compute dtype on arrival; a checkpoint that ships "
                             "quantized experts (GPT-OSS mxfp4, DeepSeek-V3 fp8-block) keeps them as stored",
                             ("checkpoint", "int8", "int4", "int4-g32", "int4-g64", "mxfp4", "fp8-block"))
    repack_dir: str | None = opt(None, "disk tier: directory of the aligned expert repack (default: "
                                 "<checkpoint>/.specmoe, else ~/.cache/specmoe/<hash>)", type=str)
    io_depth: int = opt(1, "disk tier on CPU: expert reads in flight at once, each on its own I/O thread "
                           "(1: one read after another)")

    def __post_init__(self):
        check_int("io_depth", self.io_depth, 1, 16)
        for name in ("cache_bytes", "memory_budget"):  # LLM(cache_bytes="2GiB") as well as ints
            try:
                object.__setattr__(self, name, size(getattr(self, name)))
            except SizeError as e:
                raise InputError(f"{name}: {e}") from None
        check_choices(self)
        if self.cache_policy is None:  # the tier's default: s3fifo won on natural text from the disk tier
            object.__setattr__(self, "cache_policy", "s3fifo" if self.offload == "disk" else "adaptive")
        check_int("cache_experts", self.cache_experts, 1, none_ok=True)
        check_number("link_gbps", self.link_gbps, none_ok=True)
        check_number("link_latency_us", self.link_latency_us, lo_open=False, none_ok=True)
        if self.offload != "host" and (self.link_gbps is not None or self.link_latency_us is not None):
            raise InputError("link_gbps / link_latency_us emulate the host-device link: they need offload='host'")
        r = self.repack_dir
        if r is not None and (not isinstance(r, (str, os.PathLike)) or not str(r).strip() or "\0" in str(r)):
            raise InputError(f"repack_dir must be a directory path (or None for the default), got {r!r}")


@dataclass(frozen=True)
class SpecConfig:
    """Decoding strategy and speculative-decoding knobs (see specmoe/decoding)."""
    decoding: str = opt("ar", "decoding strategy: plain autoregressive (ar), speculation at a fixed gamma with one "
                        "drafter (specmoe), or auto (each step a controller over a calibrated cost model picks a "
                        "plain step or speculation, and per sequence a drafter and its draft length)",
                        ("ar", "specmoe", "auto"))
    draft_experts: int = opt(4, "self drafter (SpecMoE): draft experts N per MoE layer, pinned in the expert cache's "
                             "slots and read in place (the draft uses only these)")
    num_draft_tokens: int = opt(4, "speculation: most tokens drafted per sequence per step (gamma; decoding=auto "
                                "chooses a length up to it per sequence)")
    substitution: str = opt("affinity", "self drafter: how the draft replaces a routed non-draft expert: nearest draft "
                            "expert by weight distance (affinity), top-k among draft experts by router score "
                            "(mask), or a random draft expert (random, ablation)", ("affinity", "mask", "random"))
    draft_policy: str = opt("hot-temporal", "self drafter: draft-set policy: top-N experts of the last verification "
                            "(hot-temporal), static from a profile (hot-global), or random (ablation)",
                            ("hot-temporal", "hot-global", "random"))
    seed: int = opt(0, "self drafter: seed of the random substitution / random draft-set modes")
    drafter: str | None = opt(None, "speculation's draft source: the model's own draft experts (self), "
                              "prompt/output lookup of the sequence's last n tokens (ngram: no compute, no expert "
                              "bytes), or an EAGLE head over the target's last hidden state (eagle: a small dense "
                              "layer, no expert bytes); default: self for decoding=specmoe, every drafter available "
                              "for decoding=auto (self, eagle where a head is found, ngram); with decoding=auto, "
                              "the one drafter auto may use",
                              ("self", "ngram", "eagle"), type=str)
    eagle_head: str | None = opt(None, "eagle drafter: an EAGLE / EAGLE-3 head directory (config.json + "
                                 "model.safetensors, published layout); default: the checkpoint's own eagle/ "
                                 "subdirectory (a widened copy's), else the head shipped for the demo model",
                                 type=str)
    eagle_draft_vocab: int | None = opt(None, "eagle drafter, EAGLE-1 head: score drafts over only the N most "
                                        "frequent target tokens (the ranking shipped beside the head, "
                                        "draft_vocab.safetensors), not the full vocabulary; 0: full vocabulary; "
                                        "default: the size that ranking file recommends, else full", type=int)
    ngram_min: int = opt(2, "ngram drafter: shortest suffix length n matched against the history")
    ngram_max: int = opt(4, "ngram drafter: longest suffix length n matched (the longest match wins)")
    draft_selection: str = opt("all", "speculation, any drafter: verify every proposed token (all), or per step "
                               "the prefix of each proposal (of a tree: an ancestor-closed subtree) that maximises "
                               "expected tokens per second of verification, from measured acceptance per depth and "
                               "verification time per row, plus the experts each node adds to the verification "
                               "when experts are offloaded (cost: SpecFit + EcoSpec), or without that expert term "
                               "(cost-compute, SpecFit alone)",
                               ("all", "cost", "cost-compute"))
    verify_expert_budget: int | None = opt(None, "speculation, LOSSY: per MoE layer, a verification forward uses "
                                           "only the K experts of most routing mass plus each token's top-1; "
                                           "tokens re-route among them (MoE-Spec; softmax top-k routers: Mixtral, "
                                           "Qwen2-MoE, Qwen3-MoE, OLMoE)", type=int)
    draft_tree: bool = opt(False, "speculation (specmoe or auto): propose and verify a token tree per sequence "
                           "(ngram: up to draft_tree_width distinct continuations from the history merged into a "
                           "trie; self, eagle: the draft's chain plus its next most likely tokens at every depth as "
                           "leaves), one forward "
                           "with a tree attention mask; the accepted path's K/V is compacted in place; under auto, "
                           "each drafter gets a tree arm beside its chain arms and measured speed picks between them")
    draft_tree_width: int = opt(3, "draft_tree: most branches per tree (continuations; at most width x gamma nodes)")
    deterministic: bool = opt(False, "fp32: pad every matrix product, and each routed expert's rows, to the row "
                              "count from which this CPU's fp32 kernels round a row alike whatever rows come with "
                              "it (measured once per machine: 4 to 16), so that a request's tokens do not depend on "
                              "what runs beside or before it; bf16/fp16 and "
                              "attention are batch-invariant without it; costs fp32 decode speed at small batches "
                              "(see docs/models.md, Determinism)")
    auto_memory: bool = opt(True, "decoding=auto: start from what earlier engines learned on this machine for this "
                            "model, dtype, tier and drafter set (each drafter's acceptance, weighted as a few dozen "
                            "rows, and the step-time corrections; a small JSON file in the user cache, "
                            "$XDG_CACHE_HOME/specmoe/auto) and keep that file updated")
    draft_prefetch: bool = opt(False, "self drafter, offloaded: while drafting, load the experts the target's routers "
                               "pick for the drafted tokens into free cache slots, so the backing tier works "
                               "while the draft computes (draft-guided prefetch)")

    def __post_init__(self):
        check_choices(self)
        if not isinstance(self.draft_prefetch, bool):
            raise InputError(f"draft_prefetch must be True or False, got {self.draft_prefetch!r}")
        if not isinstance(self.auto_memory, bool):
            raise InputError(f"auto_memory must be True or False, got {self.auto_memory!r}")
        if not isinstance(self.deterministic, bool):
            raise InputError(f"deterministic must be True or False, got {self.deterministic!r}")
        if not isinstance(self.draft_tree, bool):
            raise InputError(f"draft_tree must be True or False, got {self.draft_tree!r}")
        check_int("draft_tree_width", self.draft_tree_width, 1, 16)
        if self.draft_tree and self.decoding == "ar":
            raise InputError("draft_tree=True needs speculation (decoding='specmoe' or 'auto')")
        check_int("draft_experts", self.draft_experts, 1)
        check_int("num_draft_tokens", self.num_draft_tokens, 1, MAX_DRAFT_TOKENS)
        check_int("seed", self.seed, *SEED_RANGE)
        check_int("ngram_min", self.ngram_min, 1)
        check_int("ngram_max", self.ngram_max, self.ngram_min)
        check_int("verify_expert_budget", self.verify_expert_budget, 1, none_ok=True)
        if self.verify_expert_budget is not None and self.decoding == "ar":
            raise InputError("verify_expert_budget applies to speculative verification (decoding='specmoe' or "
                             "'auto')")
        h = self.eagle_head
        if h is not None and (not isinstance(h, (str, os.PathLike)) or not str(h).strip() or "\0" in str(h)):
            raise InputError(f"eagle_head must be a directory path (or None for the default), got {h!r}")
        if h is not None and self.drafter not in ("eagle", None):
            raise InputError("eagle_head applies to drafter='eagle' (or decoding='auto' without a drafter)")
        check_int("eagle_draft_vocab", self.eagle_draft_vocab, 0, none_ok=True)
        if self.eagle_draft_vocab is not None and self.drafter not in ("eagle", None):
            raise InputError("eagle_draft_vocab applies to drafter='eagle' (or decoding='auto' without a drafter)")


def check_choices(cfg) -> None:
    for f in fields(cfg):
        choices, v = f.metadata.get("choices"), getattr(cfg, f.name)
        if choices and v is None and f.default is None:
            continue
        if choices and (not isinstance(v, str) or v not in choices):
            raise InputError(f"{f.name}={v!r}; choose one of {', '.join(choices)}")


def split_options(kwargs: dict) -> tuple[OffloadConfig, SpecConfig]:
    """Route LLM(**kwargs) keywords to the config that owns them; unknown names are an error."""
    groups = {}
    for cls in (OffloadConfig, SpecConfig):
        names = {f.name for f in fields(cls)}
        groups[cls] = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
    if kwargs:
        raise InputError(f"unknown option(s): {', '.join(sorted(kwargs))}")
    return OffloadConfig(**groups[OffloadConfig]), SpecConfig(**groups[SpecConfig])
