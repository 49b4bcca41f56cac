"""Per-request decoding state shared by the engine and every decoding strategy."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specmoe.decoding.sampling import SamplingParams


@dataclass
class Sequence:
    """One request being decoded. Invariant: the KV cache slot `slot` holds keys/values for
    `all_ids[:-1]`; the last token is the pending input of the next forward. (Right after
    prefill the cache holds the whole prompt and `output_ids` holds the first sampled token.)"""
    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    slot: int
    generator: torch.Generator
    output_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)
