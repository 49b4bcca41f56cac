"""Llama-4's language model (`llama4_text`; the multimodal release `llama4` nests it, see llama4.py).

Its deltas: MoE layers interleaved with dense ones (`interleave_moe_layer_step` or `moe_layers`; dense layers are
`intermediate_size_mlp` wide, experts and the ungated shared expert `intermediate_size`); a top-k router (top-k of
the logits, then the sigmoid of the chosen ones) whose score scales the expert's *input*; experts fused per layer
([E, D, 2I] gate|up, [E, I, D] down); NoPE layers (`no_rope_layers[i] == 0`: no rotation, and with
`attn_temperature_tuning` the query scaled by log1p(floor((p + 1) / floor_scale)) · attn_scale + 1); chunked
local attention (`attention_chunk_size`) and the weightless L2 q/k norm (`use_qk_norm`) on the rotary layers;
rotary pairs interleaved (complex form); rope_type "llama3" scaling."""
from __future__ import annotations

from specmoe.config import Fields
from specmoe.families.registry import Family, FamilyNames, Shape, register


def _flag(f: Fields, key: str, default: bool) -> bool:
    """A switch transformers reads by truth value (the published Scout config writes attn_temperature_tuning: 4)."""
    v = f.raw.get(key)
    if v is None:
        return default
    if type(v) is not bool and (type(v) is not int or v < 0):
        f.fail(key, "true, false or a non-negative integer", v)
    return bool(v)


def read(f: Fields, shape: Shape) -> dict:
    L = shape.num_layers
    step = f.int("interleave_moe_layer_step", default=1, hi=L)
    moe = f.raw.get("moe_layers")
    if moe is None:  # transformers' default: every step-th layer, the last of each step
        moe = list(range(step - 1, L, step))
    if not isinstance(moe, list) or not moe or any(type(i) is not int or not 0 <= i < L for i in moe) \
            or len(set(moe)) != len(moe):
        f.fail("moe_layers", f"a non-empty list of distinct layer indices in [0, {L})", moe)
    inter = f.int("intermediate_size")
    dense = len(moe) < L
    kw = {"expert_intermediate_size": inter, "moe_layers": tuple(sorted(moe)),
          "dense_intermediate_size": f.int("intermediate_size_mlp") if dense else 0,
          "shared_expert_intermediate_size": inter, "shared_expert_gate": False, "routed_input_scaled": True,
          "rope_interleave": True}
    # no_rope_layers[i]: 1 = layer i rotates, 0 = NoPE (transformers' naming); [] or absent: every
    # no_rope_layer_interval-th layer is NoPE
    interval = f.int("no_rope_layer_interval", default=4)
    rotates = f.raw.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(L)]
    if not isinstance(rotates, list) or len(rotates) != L or any(v not in (0, 1) or type(v) is float
                                                                for v in rotates):
        f.fail("no_rope_layers", f"a list of {L} entries, each 1 (rotary) or 0 (NoPE)", f.raw.get("no_rope_layers"))
    nope = tuple(i for i, v in enumerate(rotates) if not v)
    chunk = None if "attention_chunk_size" in f.raw and f.raw["attention_chunk_size"] is None \
        else f.int("attention_chunk_size", default=8192)
    types = f.raw.get("layer_types")
    if types is None:  # transformers' default: chunked on the rotary layers when there is a chunk size
        types = ["chunked_attention" if v and chunk is not None else "full_attention" for v in rotates]
    if not isinstance(types, list) or len(types) != L or any(
            t not in ("chunked_attention", "full_attention") for t in types):
        f.fail("layer_types", f"a list of {L} entries, each \"chunked_attention\" or \"full_attention\"", types)
    chunked = tuple(i for i, t in enumerate(types) if t == "chunked_attention")
    if chunked and chunk is None:
        f.fail("attention_chunk_size", "an integer >= 1 (layer_types has chunked_attention layers)", None)
    kw.update(nope_layers=nope, attention_chunk_size=chunk if chunked else None, chunked_layers=chunked,
              qk_norm="l2" if f.bool("use_qk_norm", True) else None)
    if nope and _flag(f, "attn_temperature_tuning", True):
        kw.update(attn_floor_scale=f.float("floor_scale", 8192.0),
                  attn_scale=f.float("attn_scale", 0.1, positive=False))
    bias = f.bool("attention_bias", False)  # transformers: q/k/v and o projections all biased
    return {**kw, "qkv_bias": bias, "o_proj_bias": bias}


FAMILY = register(Family("llama4_text", "Llama-4", read, experts_key=("num_local_experts",), rope_theta=500000.0,
                         llama3_rope=True, quantizations=(), router_kind="topk-sigmoid", fused_experts="halves",
                         names=FamilyNames("feed_forward", ("gate_up_proj", "gate_up_proj", "down_proj"),
                                           router="router", dense_prefix="feed_forward", shared="shared_expert")))