"""Build the decoding strategy a SpecConfig asks for."""
from __future__ import annotations

from specmoe.decoding.autoregressive import AutoregressiveDecoder
from specmoe.decoding.runner import ModelRunner
from specmoe.engine.options import SpecConfig


def make_strategy(runner: ModelRunner, cfg: SpecConfig, *, engine=None):
    """`engine` is the LLM (for checkpoint path, profiles, config) when a strategy needs it."""
    return AutoregressiveDecoder(runner)


def lookahead(cfg: SpecConfig) -> int:
    """KV positions a strategy may write past a sequence's committed length in one step."""
    return 1
