"""Qwen2-MoE: Qwen's sparse-layer layout, q/k/v biases, a shared expert behind a sigmoid gate."""
from __future__ import annotations

from specmoe.config import Fields
from specmoe.families.parts import qwen_moe
from specmoe.families.registry import Family, Shape, register


def read(f: Fields, shape: Shape) -> dict:
    return {**qwen_moe(f, shape.num_layers, "qwen2_moe"), "qkv_bias": f.bool("qkv_bias", True),
            "shared_expert_intermediate_size": f.int("shared_expert_intermediate_size", default=0, lo=0)}


FAMILY = register(Family("qwen2_moe", "Qwen2-MoE", read))
