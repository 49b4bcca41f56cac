"""Qwen3.5-MoE as published (`qwen3_5_moe`, multimodal): its language model is `qwen3_5_moe_text`, read from
config.json's `text_config` and the `model.language_model.*` keys. The vision tower (`model.visual.*`) is not
loaded: text in, text out."""
from __future__ import annotations

from specmoe.config import Fields
from specmoe.families import qwen3_5_moe_text
from specmoe.families.registry import Family, Shape, register


def read(f: Fields, shape: Shape) -> dict:
    return {**qwen3_5_moe_text.read(f, shape), "weight_prefix": "model.language_model.",
            "skipped_prefixes": ("mtp.", "model.visual.")}


FAMILY = register(Family("qwen3_5_moe", "Qwen3.5-MoE (multimodal)", read, partial_rotary_factor=0.25,
                         text_config=True))
