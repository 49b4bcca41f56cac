"""DeepSeek-V2: V3's attention and layout; a softmax router (greedy, or group-limited by each group's best
expert), weights not renormalised (as transformers), times routed_scaling_factor; rotary pairs interleaved."""
from __future__ import annotations

from specmoe.config import Fields
from specmoe.families.parts import first_dense, groups, mla, shared_experts
from specmoe.families.registry import Family, Shape, register


def read(f: Fields, shape: Shape) -> dict:
    inter = f.int("moe_intermediate_size")
    method = f.str("topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy"):
        f.fail("topk_method", '"greedy" or "group_limited_greedy"', method)
    limited = groups(f, shape.num_experts, shape.top_k, n_group=1, topk_group=1) \
        if method == "group_limited_greedy" else {}
    return {"expert_intermediate_size": inter, **first_dense(f, shape.num_layers, 0), **shared_experts(f, inter),
            **limited, "routed_scaling_factor": f.float("routed_scaling_factor", 1.0), "norm_topk_prob": False,
            **mla(f),
            "rope_interleave": True}


FAMILY = register(Family("deepseek_v2", "DeepSeek-V2", read, experts_key=("n_routed_experts",), yarn=True,
                         router_kind="softmax-group-topk"))
