"""Per-request decoding state shared by the engine and every decoding strategy."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specmoe.decoding.runtime.sampling import SamplingParams


@dataclass
class Sequence:
    """One request being decoded. Invariant: the KV cache slot `slot` holds keys/values for every
    token of `prompt_ids + output_ids` but the last, which is the pending input of the next forward.
    (Right after prefill the cache holds the whole prompt and `output_ids` the first sampled token.)"""
    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    slot: int
    generator: torch.Generator
    output_ids: list[int] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    # encoder–decoder models: the source the encoder reads (its special tokens included), encoded at admission
    # (`ModelRunner.encode`); `prompt_ids` are then the decoder's prompt
    source_ids: list[int] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)
