"""GLM-4.5 MoE (`glm4_moe`): partial rotary embeddings, dense first layers, shared experts, sigmoid routing with
a correction bias over groups, optional q/k norm and multi-token-prediction layers (stored, not loaded)."""
from __future__ import annotations

from specmoe.config import Fields
from specmoe.families.parts import first_dense, grouped_sigmoid_router, partial_rope, shared_experts
from specmoe.families.registry import Family, Shape, register


def read(f: Fields, shape: Shape) -> dict:
    inter = f.int("moe_intermediate_size")
    return {"expert_intermediate_size": inter, **first_dense(f, shape.num_layers, 1), **shared_experts(f, inter),
            **grouped_sigmoid_router(f, shape.num_experts, shape.top_k, n_group=1, topk_group=1, scale=1.0),
            "qkv_bias": f.bool("attention_bias", False), "qk_norm": "head" if f.bool("use_qk_norm", False) else None,
            **partial_rope(f, shape.head_dim, shape.partial_rotary_factor),
            "extra_layers": f.int("num_nextn_predict_layers", default=0, lo=0)}


FAMILY = register(Family("glm4_moe", "GLM-4.5 MoE", read, experts_key=("n_routed_experts",),
                         partial_rotary_factor=0.5, router_kind="sigmoid-group-topk"))
