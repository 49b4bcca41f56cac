"""config.json readers that several families share: YaRN, dense-first layouts, shared experts, group-limited
routing, DeepSeek's latent attention, Qwen's sparse-layer layout, Qwen's hybrid linear/full attention layout."""
from __future__ import annotations

from specmoe.config import MLA, Fields, LinearAttention, Llama3Rope, Yarn
from specmoe.errors import UnsupportedModelError


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


def read_llama3_rope(f: Fields, rope: dict) -> Llama3Rope:
    """rope_type "llama3" (Llama-4's release): every parameter is required, as transformers requires it."""
    key = "rope_parameters" if f.raw.get("rope_parameters") else "rope_scaling"
    r = Fields(rope, f"{f.source} {key}")
    lo, hi = r.float("low_freq_factor", None), r.float("high_freq_factor", None)
    for name, v in (("factor", r.float("factor", None)), ("low_freq_factor", lo), ("high_freq_factor", hi)):
        if v is None:
            r.fail(name, "a finite number > 0")
    if hi < lo:  # equal (Llama-4 Scout's release): no band is interpolated
        r.fail("high_freq_factor", f"a number >= low_freq_factor ({lo})", hi)
    return Llama3Rope(factor=r.float("factor", None), low_freq_factor=lo, high_freq_factor=hi,
                      original_max_position_embeddings=r.int("original_max_position_embeddings"))


def first_dense(f: Fields, num_layers: int, default: int) -> dict:
    """Layers [0, first_k_dense_replace) are dense MLPs, the rest MoE."""
    k = f.int("first_k_dense_replace", default=default, lo=0, hi=num_layers - 1)
    return {"moe_layers": tuple(range(k, num_layers)),
            "dense_intermediate_size": f.int("intermediate_size", lo=1) if k else 0}


def groups(f: Fields, num_experts: int, top_k: int, *, n_group: int, topk_group: int) -> dict:
    """Group-limited top-k: n_group groups of experts, only the topk_group best are eligible."""
    g = f.int("n_group", default=n_group, hi=num_experts)
    if num_experts % g or num_experts // g < 2:
        f.fail("n_group", f"a divisor of the {num_experts} routed experts that leaves >= 2 experts per group", g)
    tg = f.int("topk_group", default=min(topk_group, g), hi=g)
    if tg * (num_experts // g) < top_k:
        f.fail("topk_group", f"a number of groups holding at least num_experts_per_tok ({top_k}) experts "
                             f"({num_experts // g} per group)", tg)
    return {"n_group": g, "topk_group": tg}


def grouped_sigmoid_router(f: Fields, num_experts: int, top_k: int, *, n_group: int, topk_group: int,
                           scale: float) -> dict:
    """Sigmoid scores + e_score_correction_bias, group-limited top-k, routed scaling factor."""
    return {**groups(f, num_experts, top_k, n_group=n_group, topk_group=topk_group), "score_correction_bias": True,
            "routed_scaling_factor": f.float("routed_scaling_factor", scale),
            "norm_topk_prob": f.bool("norm_topk_prob", True)}


def shared_experts(f: Fields, inter: int) -> dict:
    """n_shared_experts experts of the routed experts' size, always active, ungated."""
    return {"shared_expert_intermediate_size": inter * f.int("n_shared_experts", default=1, lo=0),
            "shared_expert_gate": False}


def mla(f: Fields) -> dict:
    """DeepSeek's multi-head latent attention fields (V2 and V3)."""
    m = MLA(q_lora_rank=f.int("q_lora_rank", default=None), kv_lora_rank=f.int("kv_lora_rank"),
            qk_nope_head_dim=f.int("qk_nope_head_dim"), qk_rope_head_dim=f.int("qk_rope_head_dim"),
            v_head_dim=f.int("v_head_dim"))
    if m.qk_rope_head_dim % 2:
        f.fail("qk_rope_head_dim", "an even integer", m.qk_rope_head_dim)
    bias = f.bool("attention_bias", False)
    if f.int("pretraining_tp", default=1) != 1:
        raise UnsupportedModelError("DeepSeek with pretraining_tp != 1 is not supported")
    return {"mla": m, "head_dim": m.qk_nope_head_dim + m.qk_rope_head_dim, "qkv_bias": bias, "o_proj_bias": bias}


def qwen_moe(f: Fields, num_layers: int, model_type: str) -> dict:
    """Qwen2-MoE / Qwen3-MoE: sparse layers every decoder_sparse_step-th, except mlp_only_layers (dense)."""
    L = num_layers
    step = f.int("decoder_sparse_step", default=1)
    mlp_only = f.raw.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list) or any(type(i) is not int or not 0 <= i < L for i in mlp_only):
        f.fail("mlp_only_layers", f"a list of layer indices in [0, {L})", f.raw.get("mlp_only_layers"))
    moe_layers = tuple(i for i in range(L) if i not in set(mlp_only) and (i + 1) % step == 0)
    if not moe_layers:
        f.fail("decoder_sparse_step / mlp_only_layers", "settings that leave at least one MoE layer",
               (step, mlp_only))
    dense = len(moe_layers) < L
    kw = {"expert_intermediate_size": f.int("moe_intermediate_size"),
          "dense_intermediate_size": f.int("intermediate_size", default=0, lo=1 if dense else 0),
          "norm_topk_prob": f.bool("norm_topk_prob", False), "moe_layers": moe_layers}
    if dense and not kw["dense_intermediate_size"]:
        f.fail("intermediate_size", "an integer >= 1 (the model has dense layers)")
    if f.bool("use_sliding_window", False):
        raise UnsupportedModelError(f"{model_type} with use_sliding_window=true is not supported yet")
    return kw


def partial_rope(f: Fields, head_dim: int, prf: float) -> dict:
    """Partial rotary embeddings: the first head_dim · partial_rotary_factor dims of a head rotate."""
    rope_dim = int(head_dim * prf)
    if rope_dim < 2 or rope_dim % 2:
        f.fail("partial_rotary_factor", f"a factor that leaves an even number >= 2 of the {head_dim} head dims "
                                        "rotating", prf)
    return {"rope_dim": rope_dim}


def qwen_hybrid(f: Fields, shape, *, split_projections: bool) -> dict:
    """Qwen3-Next / Qwen3.5 hybrid attention: `layer_types` (or every full_attention_interval-th layer full
    attention, the rest Gated DeltaNet linear attention), gated full attention with partial rotary, zero-centred
    RMSNorms."""
    L = shape.num_layers
    types = f.raw.get("layer_types")
    if types is None:
        every = f.int("full_attention_interval", default=4)
        types = ["full_attention" if (i + 1) % every == 0 else "linear_attention" for i in range(L)]
    if (not isinstance(types, list) or len(types) != L
            or any(t not in ("linear_attention", "full_attention") for t in types)):
        f.fail("layer_types", f"a list of {L} entries, each linear_attention or full_attention", types)
    linear = tuple(i for i, t in enumerate(types) if t == "linear_attention")
    if len(linear) == L:
        f.fail("layer_types", "a list with at least one full_attention layer", types)
    la = LinearAttention(num_k_heads=f.int("linear_num_key_heads"), num_v_heads=f.int("linear_num_value_heads"),
                         k_head_dim=f.int("linear_key_head_dim"), v_head_dim=f.int("linear_value_head_dim"),
                         conv_kernel=f.int("linear_conv_kernel_dim", default=4), split_projections=split_projections)
    if la.num_v_heads % la.num_k_heads:
        f.fail("linear_num_value_heads", f"a multiple of linear_num_key_heads ({la.num_k_heads})", la.num_v_heads)
    bias = f.bool("attention_bias", False)
    return {"linear_attention": la, "linear_layers": linear, "attn_output_gate": True, "norm_offset": True,
            "qk_norm": "head", "qkv_bias": bias, "o_proj_bias": bias,
            **partial_rope(f, shape.head_dim, shape.partial_rotary_factor)}
