"""The engine's counters and memory parts, typed; `LLM.stats` joins them with the decoding strategy's and the
expert store's own sections into one flat dict (`to_dict`)."""
from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field

from specmoe.decoding.runtime.breakdown import finish, merge
from specmoe.models.kv_cache import EncDecCache


@dataclass
class EngineStats:
    """What the engine did since the LLM was built or `reset_stats`: requests, tokens, time by phase. The
    decoding strategy's counters (`strategy`, its own dict) and decode-time phases (`step_breakdown`) join
    when an engine session closes."""
    requests: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_time_s: float = 0.0
    decode_time_s: float = 0.0
    decode_steps: int = 0
    scheduling_s: float = 0.0  # admission, KV growth, appending tokens, stop checks, slot release
    step_breakdown: dict[str, float] = field(default_factory=dict)  # decoding.breakdown's phases, summed
    strategy: dict = field(default_factory=dict)  # the last closed session's strategy counters

    def close_session(self, strategy: dict) -> None:
        """Keep a finished engine session's strategy counters; sum its phases into `step_breakdown`."""
        strategy = dict(strategy)
        merge(self.step_breakdown, strategy.pop("step_breakdown", {}))
        self.strategy = strategy

    @property
    def timed_s(self) -> float:
        return self.prefill_time_s + self.decode_time_s

    def to_dict(self, live_strategy: dict | None = None) -> dict:
        """The counters, the rates and the strategy's section (`live_strategy`: a running session's, else the
        last closed one's), with the step breakdown finished (its parts add up to the decode wall time)."""
        s = {k: v for k, v in asdict(self).items() if k not in ("strategy", "step_breakdown")}
        total = self.timed_s
        s["tokens_per_s"] = self.generated_tokens / total if total else 0.0
        s["decode_tokens_per_s"] = self.generated_tokens / self.decode_time_s if self.decode_time_s else 0.0
        s["prefill_tokens_per_s"] = self.prompt_tokens / self.prefill_time_s if self.prefill_time_s else 0.0
        strategy = dict(self.strategy if live_strategy is None else live_strategy)
        parts = merge(dict(self.step_breakdown), strategy.pop("step_breakdown", {}))
        s.update(strategy)
        s["step_breakdown"] = finish(parts, decode_time_s=self.decode_time_s, scheduling_s=self.scheduling_s)
        return s


@dataclass
class MemoryStats:
    """Bytes per part: the non-expert weights (model parameters and buffers), each expert part of the
    ExpertMemory plan (what memory_budget / cache_bytes bound; the draft's parts are held while a speculative
    run is active) and the KV cache as allocated now; the limits set."""
    non_expert_weights: int
    experts: dict[str, int]
    kv_cache: int
    experts_total: int
    memory_budget: int | None
    cache_bytes: int | None
    linear_state: int = 0  # of kv_cache: hybrid models' linear-attention states (constant in the sequence length)
    cross_kv_cache: int | None = None  # encoder–decoder models: the cross-attention K/V kept per sequence

    @classmethod
    def measure(cls, model, expert_memory, kv_cache) -> "MemoryStats":
        weights = sum(t.numel() * t.element_size() for t in itertools.chain(model.parameters(), model.buffers()))
        cross = kv_cache.cross_nbytes if isinstance(kv_cache, EncDecCache) else None
        return cls(non_expert_weights=weights, experts=dict(expert_memory.parts),
                   kv_cache=kv_cache.nbytes if kv_cache is not None else 0, experts_total=expert_memory.total,
                   memory_budget=expert_memory.memory_budget, cache_bytes=expert_memory.cache_bytes,
                   linear_state=kv_cache.state_nbytes if kv_cache is not None else 0,
                   cross_kv_cache=cross)

    @property
    def total(self) -> int:
        return self.non_expert_weights + sum(self.experts.values()) + self.kv_cache + (self.cross_kv_cache or 0)

    def to_dict(self) -> dict:
        cross = {} if self.cross_kv_cache is None else {"cross_kv_cache": self.cross_kv_cache}
        return {"non_expert_weights": self.non_expert_weights, **self.experts, "kv_cache": self.kv_cache, **cross,
                "kv_cache_linear_state": self.linear_state,
                "experts_total": self.experts_total, "total": self.total, "memory_budget": self.memory_budget,
                "cache_bytes": self.cache_bytes}
