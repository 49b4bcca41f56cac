"""MiniMax-M2: RMSNorm over the whole query and key projections (one weight of Hq·Dh and Hkv·Dh values), partial
rotary embeddings (`rotary_dim`, or rope_parameters' partial_rotary_factor), a sigmoid router whose
e_score_correction_bias picks the experts and whose chosen sigmoid scores, renormalised, weight them (no scaling
factor), Mixtral's expert names (`block_sparse_moe.experts.{e}.w1/w2/w3`), every layer MoE."""
from __future__ import annotations

from specmoe.config import Fields
from specmoe.errors import UnsupportedModelError
from specmoe.families.registry import Family, FamilyNames, Shape, register


def _rope_dim(f: Fields, shape: Shape) -> int:
    """Rotating dims per head: partial_rotary_factor (rope_parameters or top level) wins, as transformers reads
    it; else the released checkpoints' `rotary_dim`; else the whole head."""
    head_dim = shape.head_dim
    rope = f.raw.get("rope_parameters") or {}
    if rope.get("partial_rotary_factor") is not None or f.raw.get("partial_rotary_factor") is not None:
        dim, key = int(head_dim * shape.partial_rotary_factor), "partial_rotary_factor"
    else:
        dim, key = f.int("rotary_dim", default=head_dim, hi=head_dim), "rotary_dim"
    if dim < 2 or dim % 2:
        f.fail(key, f"a value that leaves an even number >= 2 of the {head_dim} head dims rotating",
               f.raw.get(key, rope.get(key)))
    return dim


def read(f: Fields, shape: Shape) -> dict:
    # options of the released config.json that transformers' MiniMaxM2 implements one way only
    for key, want in (("scoring_func", "sigmoid"), ("qk_norm_type", "per_layer")):
        if f.str(key, want) != want:
            raise UnsupportedModelError(f"{f.source}: {key} {f.raw[key]!r} is not supported (only {want!r})")
    for key, want in (("use_qk_norm", True), ("use_routing_bias", True)):
        if f.bool(key, want) != want:
            raise UnsupportedModelError(f"{f.source}: {key}={str(not want).lower()} is not supported")
    if f.int("shared_intermediate_size", default=0, lo=0):
        raise UnsupportedModelError(f"{f.source}: shared_intermediate_size > 0 (a shared expert) is not supported")
    types = f.raw.get("attn_type_list")
    if types is not None and (not isinstance(types, list) or any(t != 1 for t in types)):
        raise UnsupportedModelError(f"{f.source}: attn_type_list other than all 1 (full attention) is not supported "
                                    "(MiniMax-M2 has no linear-attention layers)")
    return {"expert_intermediate_size": f.int("intermediate_size"), "dense_intermediate_size": 0,
            "qk_norm": "full", "rope_dim": _rope_dim(f, shape), "score_correction_bias": True,
            "norm_topk_prob": True, "routed_scaling_factor": 1.0}


FAMILY = register(Family("minimax_m2", "MiniMax-M2", read, experts_key=("num_local_experts",),
                         rope_theta=5000000.0, partial_rotary_factor=1.0, router_kind="sigmoid-group-topk",
                         names=FamilyNames("block_sparse_moe", ("w1", "w3", "w2"),
                                           correction_bias="e_score_correction_bias")))
