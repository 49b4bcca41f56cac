"""Boundary dataclasses returned to users."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" (EOS or stop string) | "length" (max_tokens or context end)
