"""DeepSeek-V3 (and Kimi-K2, which ships its architecture as `kimi_k2`): multi-head latent attention, YaRN,
dense first layers, a shared expert, sigmoid routing with a correction bias over groups, interleaved rotary
pairs, multi-token-prediction layers (stored, not loaded)."""
from __future__ import annotations

from specmoe.config import Fields
from specmoe.families.parts import first_dense, grouped_sigmoid_router, mla, shared_experts
from specmoe.families.registry import Family, Shape, register


def read(f: Fields, shape: Shape) -> dict:
    inter = f.int("moe_intermediate_size")
    return {"expert_intermediate_size": inter, **first_dense(f, shape.num_layers, 3), **shared_experts(f, inter),
            **grouped_sigmoid_router(f, shape.num_experts, shape.top_k, n_group=8, topk_group=4, scale=2.5),
            **mla(f), "rope_interleave": f.bool("rope_interleave", True),
            "extra_layers": f.int("num_nextn_predict_layers", default=0, lo=0)}


FAMILY = register(Family("deepseek_v3", "DeepSeek-V3", read, experts_key=("n_routed_experts",), aliases=("kimi_k2",),
                         yarn=True, router_kind="sigmoid-group-topk"))
