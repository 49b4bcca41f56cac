"""The registry of supported families: `Family` (how one family's config.json differs from the generic
decoder's), `register`, and `family_of(model_type)`. Each family's module under specmoe/families/ registers
itself; `specmoe.families` imports them all."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from specmoe.config import Fields
from specmoe.errors import UnsupportedModelError


@dataclass(frozen=True)
class Shape:
    """What every family reads alike from config.json, handed to a family's reader."""
    vocab_size: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    num_experts: int
    top_k: int
    partial_rotary_factor: float
    rope: dict  # rope_parameters / rope_scaling, or the family's default ({}: plain RoPE)


@dataclass(frozen=True)
class Family:
    """One supported architecture. `read(f, shape)` returns the `ModelConfig` fields in which it differs from
    the generic decoder, every value read through `f` (typed, range-checked, a CheckpointError naming the key);
    defaults are the values the family's published checkpoints carry."""
    model_type: str
    name: str  # as its publisher writes it, for messages
    read: Callable[[Fields, Shape], dict]
    experts_key: tuple[str, ...] = ("num_local_experts", "num_experts")  # the routed-expert count's key(s)
    aliases: tuple[str, ...] = ()  # other model_types that are this architecture under their own name
    rope_theta: float = 10000.0  # when config.json has none
    default_rope: dict | None = None  # rope parameters when config.json has none
    yarn: bool = False  # YaRN rope scaling is read (else only plain RoPE)
    partial_rotary_factor: float | None = None  # its default when only part of a head rotates (None: all does)
    quantizations: tuple[str, ...] = ("fp8",)  # quant_methods its quantized checkpoints may use
    text_config: bool = False  # a multimodal config.json: the language model's fields are under text_config


FAMILIES: dict[str, Family] = {}  # model_type -> Family, in registration order
ALIASES: dict[str, str] = {}  # alias -> model_type


def register(family: Family) -> Family:
    FAMILIES[family.model_type] = family
    ALIASES.update(dict.fromkeys(family.aliases, family.model_type))
    return family


def families_reading(method: str) -> list[str]:
    """Names of the families whose quantized checkpoints use quant_method `method`."""
    return [f.name for f in FAMILIES.values() if method in f.quantizations]


def family_of(model_type) -> Family:
    """The family a config.json's model_type names (or aliases); UnsupportedModelError listing them if none."""
    mt = ALIASES.get(model_type, model_type) if isinstance(model_type, str) else model_type
    if mt not in FAMILIES:
        raise UnsupportedModelError(f"unsupported model_type {mt!r}; supported: {', '.join(FAMILIES)} "
                                    f"(and {', '.join(ALIASES)})")
    return FAMILIES[mt]
