"""GPT-OSS: sliding-window attention on some layers, attention sinks, biases on every projection, the router
and the experts, a clamped SwiGLU, YaRN (its published settings when config.json has none), MXFP4 experts."""
from __future__ import annotations

from specmoe.config import Fields
from specmoe.families.registry import Family, FamilyNames, Shape, register

# without rope_parameters transformers applies the published YaRN settings
PUBLISHED_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                  "original_max_position_embeddings": 4096}


def read(f: Fields, shape: Shape) -> dict:
    L = shape.num_layers
    types = f.raw.get("layer_types")
    if types is None:  # transformers' default: sliding on even layers
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(L)]
    if not isinstance(types, list) or len(types) != L or any(
            t not in ("sliding_attention", "full_attention") for t in types):
        f.fail("layer_types", f"a list of {L} entries, each \"sliding_attention\" or \"full_attention\"", types)
    bias = f.bool("attention_bias", True)
    return {"expert_intermediate_size": f.int("intermediate_size"), "dense_intermediate_size": 0,
            "sliding_window": f.int("sliding_window", default=128),
            "sliding_layers": tuple(i for i, t in enumerate(types) if t == "sliding_attention"),
            "attention_sinks": True, "qkv_bias": bias, "o_proj_bias": bias, "router_bias": True,
            "expert_bias": True, "swiglu_limit": f.float("swiglu_limit", 7.0),
            "swiglu_alpha": f.float("swiglu_alpha", 1.702)}


FAMILY = register(Family("gpt_oss", "GPT-OSS", read, rope_theta=150000.0, default_rope=PUBLISHED_ROPE, yarn=True,
                         quantizations=("mxfp4",), router_kind="topk-softmax", fused_experts="interleaved",
                         names=FamilyNames("mlp", ("gate_up_proj", "gate_up_proj", "down_proj"), router="router")))
