"""NLLB-MoE (model_type "nllb-moe"): an encoder–decoder translation model (M2M100-style: scaled embeddings,
sinusoidal positions, pre-LayerNorm, biased multi-head attention, ReLU FFNs, decoder cross-attention) whose every
`encoder_sparse_step`-th encoder layer and `decoder_sparse_step`-th decoder layer is a top-2 MoE layer with a
capacity rule (see `config.Capacity`, `routers.top2_capacity`). The `ModelConfig` sizes are the decoder's; the
encoder's are in `Seq2Seq`. Layers are numbered encoder first (`Seq2Seq`)."""
from __future__ import annotations

import math

from specmoe.config import Capacity, Fields, Seq2Seq
from specmoe.errors import UnsupportedModelError
from specmoe.families.registry import Family, FamilyNames, Shape, register


def _sparse(step: int, n: int, offset: int) -> list[int]:
    """transformers' rule: layer i is sparse iff (i + 1) % step == 0 (step <= 0: none)."""
    return [offset + i for i in range(n) if step > 0 and (i + 1) % step == 0]


def read_shape(f: Fields, rope: dict, prf: float) -> Shape:
    if rope:
        raise UnsupportedModelError("NLLB-MoE uses sinusoidal positions; config.json must not set rope parameters")
    D = f.int("d_model")
    E = f.int("num_experts")
    heads = f.int("decoder_attention_heads")
    if D % heads:
        f.fail("d_model", f"a multiple of decoder_attention_heads ({heads})", D)
    if E < 2:
        f.fail("num_experts", "an integer >= 2 (the router picks two experts)", E)
    return Shape(vocab_size=f.int("vocab_size"), hidden_size=D, num_heads=heads, num_kv_heads=heads,
                 head_dim=D // heads, num_layers=f.int("decoder_layers"), num_experts=E, top_k=2,
                 partial_rotary_factor=1.0, rope={})


def read(f: Fields, shape: Shape) -> dict:
    D, L = shape.hidden_size, shape.num_layers
    act = f.str("activation_function", "relu")
    if act != "relu":
        raise UnsupportedModelError(f"NLLB-MoE with activation_function {act!r} is not supported (only relu)")
    for key, want in (("second_expert_policy", "all"), ("router_dtype", "float32")):
        if f.str(key, want) != want:  # "sampling" / "random" draw the second expert at random: not a fixed model
            raise UnsupportedModelError(f"NLLB-MoE with {key} {f.raw[key]!r} is not supported (only {want!r})")
    Le = f.int("encoder_layers")
    enc_heads = f.int("encoder_attention_heads")
    if D % enc_heads:
        f.fail("d_model", f"a multiple of encoder_attention_heads ({enc_heads})", D)
    enc_ffn, dec_ffn = f.int("encoder_ffn_dim"), f.int("decoder_ffn_dim")
    enc_moe = _sparse(f.int("encoder_sparse_step", default=4, lo=0), Le, 0)
    dec_moe = _sparse(f.int("decoder_sparse_step", default=4, lo=0), L, Le)
    if not dec_moe and not enc_moe:
        raise UnsupportedModelError("this NLLB-MoE config has no sparse layer (encoder_sparse_step and "
                                    "decoder_sparse_step select none): it is a dense model")
    if enc_moe and dec_moe and enc_ffn != dec_ffn:
        raise UnsupportedModelError(f"NLLB-MoE with experts of two sizes (encoder_ffn_dim {enc_ffn}, decoder_ffn_dim "
                                    f"{dec_ffn}) is not supported: the expert store holds one expert size")
    fraction = f.float("moe_eval_capacity_token_fraction", 1.0, positive=False)
    capacity = Capacity(fraction=fraction, expert_capacity=f.int("expert_capacity", default=None),
                        batch_prioritized=f.bool("batch_prioritized_routing", False),
                        normalize_before_dropping=f.bool("normalize_router_prob_before_dropping", False))
    dropout = f.float("moe_token_dropout", 0.2, positive=False)
    if not 0 <= dropout < 1:
        f.fail("moe_token_dropout", "a number in [0, 1)", dropout)
    pad = f.int("pad_token_id", default=1, lo=0, hi=shape.vocab_size - 1)
    start = f.int("decoder_start_token_id", default=2, lo=0, hi=shape.vocab_size - 1)
    s2s = Seq2Seq(encoder_layers=Le, encoder_heads=enc_heads, encoder_ffn=enc_ffn, pad_token_id=pad,
                  decoder_start_token_id=start,
                  embed_scale=math.sqrt(D) if f.bool("scale_embedding", True) else 1.0, capacity=capacity)
    return {"expert_intermediate_size": enc_ffn if enc_moe else dec_ffn, "dense_intermediate_size": dec_ffn,
            "moe_layers": tuple(enc_moe + dec_moe), "norm_topk_prob": True, "qkv_bias": True, "o_proj_bias": True,
            "router_bias": f.bool("router_bias", False), "expert_bias": True, "expert_act": "relu",
            # eval: each expert output is scaled by 1 - moe_token_dropout (transformers' NllbMoeExperts)
            "routed_scaling_factor": 1.0 - dropout, "seq2seq": s2s,
            "tie_word_embeddings": f.bool("tie_word_embeddings", True)}


FAMILY = register(Family("nllb_moe", "NLLB-MoE", read, experts_key=("num_experts",), aliases=("nllb-moe",),
                         quantizations=(), shape=read_shape, router_kind="top2-capacity",
                         names=FamilyNames("ffn", ("fc1", "fc1", "fc2"), router="router.classifier")))
