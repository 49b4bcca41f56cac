"""config.json readers of the families added as deltas of the generic decoder: GLM-4.5 MoE (`glm4_moe`),
DeepSeek-V2 (`deepseek_v2`), DeepSeek-V3 / Kimi-K2 (`deepseek_v3`) and GPT-OSS (`gpt_oss`).

Each reader returns the `ModelConfig` fields in which the family differs from the generic decoder, every
value read through `Fields` (typed, range-checked, a CheckpointError naming the key). Defaults are the
values the family's published checkpoints carry, so a config.json that omits a key reads as they do.
"""
from __future__ import annotations

from specmoe.config import MLA, Fields, Yarn
from specmoe.errors import UnsupportedModelError

YARN_FAMILIES = ("deepseek_v2", "deepseek_v3", "gpt_oss")
DEFAULT_THETA = {"gpt_oss": 150000.0}
# GPT-OSS without rope_parameters: transformers applies the published YaRN settings
DEFAULT_ROPE = {"gpt_oss": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                            "truncate": False, "original_max_position_embeddings": 4096}}


def read(mt: str, f: Fields, *, num_layers: int, num_experts: int, top_k: int, head_dim: int, prf: float,
         rope: dict | None) -> dict:
    kw = {"glm4_moe": _glm4_moe, "deepseek_v2": _deepseek_v2, "deepseek_v3": _deepseek_v3, "gpt_oss": _gpt_oss}[mt](
        f, num_layers=num_layers, num_experts=num_experts, top_k=top_k, head_dim=head_dim, prf=prf)
    if rope is not None:
        kw["yarn"] = read_yarn(f, rope)
    return kw


def read_yarn(f: Fields, rope: dict) -> Yarn:
    key = "rope_parameters" if f.raw.get("rope_parameters") else "rope_scaling"
    r = Fields(rope, f"{f.source} {key}")
    orig = r.int("original_max_position_embeddings")
    factor = r.float("factor", None)
    if factor is None:  # transformers: the ratio of the context lengths
        factor = f.int("max_position_embeddings", lo=2) / orig
    return Yarn(factor=factor, original_max_position_embeddings=orig,
                beta_fast=r.float("beta_fast", 32.0), beta_slow=r.float("beta_slow", 1.0),
                mscale=r.float("mscale", None, positive=False), mscale_all_dim=r.float("mscale_all_dim", None,
                                                                                      positive=False),
                attention_factor=r.float("attention_factor", None), truncate=r.bool("truncate", True))


def _first_dense(f: Fields, num_layers: int, default: int) -> dict:
    """Layers [0, first_k_dense_replace) are dense MLPs, the rest MoE."""
    k = f.int("first_k_dense_replace", default=default, lo=0, hi=num_layers - 1)
    return {"moe_layers": tuple(range(k, num_layers)),
            "dense_intermediate_size": f.int("intermediate_size", lo=1) if k else 0}


def _groups(f: Fields, num_experts: int, top_k: int, *, n_group: int, topk_group: int) -> dict:
    """Group-limited top-k: n_group groups of experts, only the topk_group best are eligible."""
    g = f.int("n_group", default=n_group, hi=num_experts)
    if num_experts % g or num_experts // g < 2:
        f.fail("n_group", f"a divisor of the {num_experts} routed experts that leaves >= 2 experts per group", g)
    tg = f.int("topk_group", default=min(topk_group, g), hi=g)
    if tg * (num_experts // g) < top_k:
        f.fail("topk_group", f"a number of groups holding at least num_experts_per_tok ({top_k}) experts "
                             f"({num_experts // g} per group)", tg)
    return {"n_group": g, "topk_group": tg}


def _grouped_sigmoid_router(f: Fields, num_experts: int, top_k: int, *, n_group: int, topk_group: int,
                            scale: float) -> dict:
    """Sigmoid scores + e_score_correction_bias, group-limited top-k, routed scaling factor."""
    return {**_groups(f, num_experts, top_k, n_group=n_group, topk_group=topk_group), "score_correction_bias": True,
            "routed_scaling_factor": f.float("routed_scaling_factor", scale),
            "norm_topk_prob": f.bool("norm_topk_prob", True)}


def _shared(f: Fields, inter: int) -> dict:
    return {"shared_expert_intermediate_size": inter * f.int("n_shared_experts", default=1, lo=0),
            "shared_expert_gate": False}


def _glm4_moe(f: Fields, *, num_layers: int, num_experts: int, top_k: int, head_dim: int, prf: float) -> dict:
    inter = f.int("moe_intermediate_size")
    rope_dim = int(head_dim * prf)
    if rope_dim < 2 or rope_dim % 2:
        f.fail("partial_rotary_factor", f"a factor that leaves an even number >= 2 of the {head_dim} head dims "
                                        "rotating", prf)
    return {"expert_intermediate_size": inter, **_first_dense(f, num_layers, 1), **_shared(f, inter),
            **_grouped_sigmoid_router(f, num_experts, top_k, n_group=1, topk_group=1, scale=1.0),
            "qkv_bias": f.bool("attention_bias", False), "qk_norm": "head" if f.bool("use_qk_norm", False) else None,
            "rope_dim": rope_dim, "extra_layers": f.int("num_nextn_predict_layers", default=0, lo=0)}


def _mla(f: Fields) -> dict:
    """DeepSeek's multi-head latent attention fields (V2 and V3)."""
    mla = MLA(q_lora_rank=f.int("q_lora_rank", default=None), kv_lora_rank=f.int("kv_lora_rank"),
              qk_nope_head_dim=f.int("qk_nope_head_dim"), qk_rope_head_dim=f.int("qk_rope_head_dim"),
              v_head_dim=f.int("v_head_dim"))
    if mla.qk_rope_head_dim % 2:
        f.fail("qk_rope_head_dim", "an even integer", mla.qk_rope_head_dim)
    bias = f.bool("attention_bias", False)
    if f.int("pretraining_tp", default=1) != 1:
        raise UnsupportedModelError("DeepSeek with pretraining_tp != 1 is not supported")
    return {"mla": mla, "head_dim": mla.qk_nope_head_dim + mla.qk_rope_head_dim, "qkv_bias": bias,
            "o_proj_bias": bias}


def _deepseek_v3(f: Fields, *, num_layers: int, num_experts: int, top_k: int, head_dim: int, prf: float) -> dict:
    inter = f.int("moe_intermediate_size")
    return {"expert_intermediate_size": inter, **_first_dense(f, num_layers, 3), **_shared(f, inter),
            **_grouped_sigmoid_router(f, num_experts, top_k, n_group=8, topk_group=4, scale=2.5), **_mla(f),
            "rope_interleave": f.bool("rope_interleave", True),
            "extra_layers": f.int("num_nextn_predict_layers", default=0, lo=0)}


def _deepseek_v2(f: Fields, *, num_layers: int, num_experts: int, top_k: int, head_dim: int, prf: float) -> dict:
    """V3's attention and layout; softmax router (greedy, or group-limited by each group's best expert),
    weights not renormalised (as transformers), times routed_scaling_factor; rotary pairs interleaved."""
    inter = f.int("moe_intermediate_size")
    method = f.str("topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy"):
        f.fail("topk_method", '"greedy" or "group_limited_greedy"', method)
    groups = _groups(f, num_experts, top_k, n_group=1, topk_group=1) if method == "group_limited_greedy" else {}
    return {"expert_intermediate_size": inter, **_first_dense(f, num_layers, 0), **_shared(f, inter), **groups,
            "routed_scaling_factor": f.float("routed_scaling_factor", 1.0), "norm_topk_prob": False, **_mla(f),
            "rope_interleave": True}


def _gpt_oss(f: Fields, *, num_layers: int, num_experts: int, top_k: int, head_dim: int, prf: float) -> dict:
    types = f.raw.get("layer_types")
    if types is None:  # transformers' default: sliding on even layers
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(num_layers)]
    if not isinstance(types, list) or len(types) != num_layers or any(
            t not in ("sliding_attention", "full_attention") for t in types):
        f.fail("layer_types", f"a list of {num_layers} entries, each \"sliding_attention\" or \"full_attention\"",
               types)
    bias = f.bool("attention_bias", True)
    return {"expert_intermediate_size": f.int("intermediate_size"), "dense_intermediate_size": 0,
            "sliding_window": f.int("sliding_window", default=128),
            "sliding_layers": tuple(i for i, t in enumerate(types) if t == "sliding_attention"),
            "attention_sinks": True, "qkv_bias": bias, "o_proj_bias": bias, "router_bias": True,
            "expert_bias": True, "swiglu_limit": f.float("swiglu_limit", 7.0),
            "swiglu_alpha": f.float("swiglu_alpha", 1.702)}
