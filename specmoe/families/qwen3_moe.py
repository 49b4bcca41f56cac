"""Qwen3-MoE: Qwen's sparse-layer layout, RMSNorm on each query and key head."""
from __future__ import annotations

from specmoe.config import Fields
from specmoe.families.parts import qwen_moe
from specmoe.families.registry import Family, Shape, register


def read(f: Fields, shape: Shape) -> dict:
    kw = qwen_moe(f, shape.num_layers, "qwen3_moe")
    bias = f.bool("attention_bias", False)  # transformers: q/k/v and o projections all biased
    return {**kw, "qk_norm": "head", "qkv_bias": bias, "o_proj_bias": bias}


FAMILY = register(Family("qwen3_moe", "Qwen3-MoE", read))
