"""Sampling: greedy, temperature, top-k, top-p, per-request seeded generators.

`probs_from_logits` is shared with speculative decoding, whose rejection sampler must
compare draft and target distributions after exactly the same filtering."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specmoe.errors import InputError

# V=vocab


@dataclass
class SamplingParams:
    """Per-request generation settings (vLLM-compatible names)."""
    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.max_tokens < 1:
            raise InputError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise InputError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probs_from_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits [..., V] → probabilities after temperature, top-k and top-p (fp32)."""
    logits = logits.float() / p.temperature
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        cum = sorted_p.cumsum(-1)
        drop = cum - sorted_p > p.top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def sample(logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator]) -> list[int]:
    """One token per row of logits [B, V]. Greedy rows take argmax; others draw with their own generator,
    so a request's tokens do not depend on what else is in the batch."""
    out = logits.argmax(-1).tolist()
    for b, p in enumerate(params):
        if not p.greedy:
            probs = probs_from_logits(logits[b], p)
            out[b] = int(torch.multinomial(probs, 1, generator=gens[b]).item())
    return out
