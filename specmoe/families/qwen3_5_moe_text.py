"""Qwen3.5-MoE, text only (`qwen3_5_moe_text`, the config transformers writes for Qwen3_5MoeForCausalLM): the
hybrid attention of Qwen3-Next with unfused in_proj_qkv / z / b / a, every layer MoE with a sigmoid-gated
shared expert, top-k weights always renormalised. Text-only positions make its interleaved multimodal RoPE
(mrope_section) plain RoPE. The multimodal checkpoint is `qwen3_5_moe`."""
from __future__ import annotations

from specmoe.config import Fields
from specmoe.families.parts import qwen_hybrid
from specmoe.families.registry import Family, Shape, register


def read(f: Fields, shape: Shape) -> dict:
    return {"expert_intermediate_size": f.int("moe_intermediate_size"), "dense_intermediate_size": 0,
            "norm_topk_prob": True, "moe_layers": tuple(range(shape.num_layers)),
            "shared_expert_intermediate_size": f.int("shared_expert_intermediate_size", default=0, lo=0),
            **qwen_hybrid(f, shape, split_projections=True)}


FAMILY = register(Family("qwen3_5_moe_text", "Qwen3.5-MoE", read, partial_rotary_factor=0.25,
                         skipped=("mtp.",), either_layout=True))
