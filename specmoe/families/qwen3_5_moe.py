"""Qwen3.5-MoE: the hybrid attention of Qwen3-Next (in_proj_qkv / z / b / a unfused), every layer MoE with a
sigmoid-gated shared expert, top-k weights always renormalised. Two forms: `qwen3_5_moe_text` (the text-only
config transformers writes) and `qwen3_5_moe`, the published multimodal checkpoint, whose language model is read
from `text_config` and `model.language_model.*`; its vision tower (`model.visual.*`) is not loaded (text in,
text out). Text-only positions make its interleaved multimodal RoPE (mrope_section) plain RoPE."""
from __future__ import annotations

from specmoe.config import Fields
from specmoe.families.parts import qwen_hybrid
from specmoe.families.registry import Family, Shape, register


def read_text(f: Fields, shape: Shape) -> dict:
    inter = f.int("moe_intermediate_size")
    return {"expert_intermediate_size": inter, "dense_intermediate_size": 0, "norm_topk_prob": True,
            "moe_layers": tuple(range(shape.num_layers)),
            "shared_expert_intermediate_size": f.int("shared_expert_intermediate_size", default=0, lo=0),
            **qwen_hybrid(f, shape, split_projections=True), "skipped_prefixes": ("mtp.",)}


def read_multimodal(f: Fields, shape: Shape) -> dict:
    return {**read_text(f, shape), "weight_prefix": "model.language_model.",
            "skipped_prefixes": ("mtp.", "model.visual.")}


TEXT = register(Family("qwen3_5_moe_text", "Qwen3.5-MoE", read_text, partial_rotary_factor=0.25))
FAMILY = register(Family("qwen3_5_moe", "Qwen3.5-MoE (multimodal)", read_multimodal, partial_rotary_factor=0.25,
                         text_config=True))
