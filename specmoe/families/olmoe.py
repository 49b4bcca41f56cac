"""OLMoE: RMSNorm over the whole query and key projections, optional q/k/v clipping, unnormalised top-k."""
from __future__ import annotations

from specmoe.config import Fields
from specmoe.errors import UnsupportedModelError
from specmoe.families.registry import Family, Shape, register


def read(f: Fields, shape: Shape) -> dict:
    bias = f.bool("attention_bias", False)  # transformers: q/k/v and o projections all biased
    kw = {"expert_intermediate_size": f.int("intermediate_size"), "dense_intermediate_size": 0,
          "norm_topk_prob": f.bool("norm_topk_prob", False), "qk_norm": "full", "qkv_bias": bias,
          "o_proj_bias": bias, "clip_qkv": f.float("clip_qkv", None)}
    if shape.head_dim != shape.hidden_size // shape.num_heads:
        raise UnsupportedModelError("OLMoE with head_dim != hidden_size / num_attention_heads")
    return kw


FAMILY = register(Family("olmoe", "OLMoE", read))
