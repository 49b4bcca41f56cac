"""Cache memory per sequence: a hybrid model (Gated DeltaNet linear attention in 3 of 4 layers) vs the same model
with full attention in every layer, at several sequence lengths.

The hybrid model's cache holds K/V for its full-attention layers only, plus per linear layer a ring of
lookahead + 1 recurrent states (constant in the length; see specmoe/models/linear_state.py). Sizes are
Qwen3-Next-80B-A3B's published config (bf16) and a tiny model; the figures are the bytes `make_cache` allocates
(checked against the allocated tensors at a short length), for plain decoding (lookahead 1) and SpecMoE with
γ = 4 (lookahead 5).

    PYTHONPATH=. python benchmarks/hybrid_memory.py [--json]
"""
from __future__ import annotations

import argparse
import json

import torch

from specmoe.families import read_config
from specmoe.models.kv_cache import make_cache, model_cache_bytes
from specmoe.models.linear_state import for_lookahead

QWEN3_NEXT_80B = {  # Qwen/Qwen3-Next-80B-A3B-Instruct config.json (the fields the cache depends on)
    "model_type": "qwen3_next", "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 48,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "num_experts": 512,
    "num_experts_per_tok": 10, "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
    "intermediate_size": 5120, "full_attention_interval": 4, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_num_key_heads": 16,
    "linear_num_value_heads": 32, "max_position_embeddings": 262144, "rope_theta": 10000000,
    "partial_rotary_factor": 0.25, "norm_topk_prob": True, "dtype": "bfloat16"}
TINY = {**QWEN3_NEXT_80B, "vocab_size": 96, "hidden_size": 36, "num_hidden_layers": 4, "num_attention_heads": 4,
        "head_dim": 16, "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 20,
        "shared_expert_intermediate_size": 28, "linear_key_head_dim": 10, "linear_value_head_dim": 6,
        "linear_num_key_heads": 2, "linear_num_value_heads": 6, "linear_conv_kernel_dim": 3, "dtype": "float32"}
LENGTHS = (1024, 8192, 32768, 131072)


def allocated(cfg, dtype, positions: int, ring: int) -> int:
    """Bytes of the tensors `make_cache` allocates for one sequence."""
    c = make_cache(cfg, max_batch=1, max_seq=positions, dtype=dtype, ring=ring)
    t = [c.k, c.v] + (c.states.rec + c.states.conv if c.states is not None else [])
    return sum(x.numel() * x.element_size() for x in t if x is not None)


def rows(name: str, raw: dict) -> list[dict]:
    hybrid = read_config(raw)
    full = read_config({**raw, "layer_types": ["full_attention"] * raw["num_hidden_layers"]})
    dtype = getattr(torch, raw["dtype"])
    out = []
    for look in (1, 5):
        ring = for_lookahead(look)
        for cfg in (hybrid, full):  # the formula is what is allocated (checked at a short length)
            assert model_cache_bytes(cfg, dtype, 1, 256, ring) == allocated(cfg, dtype, 256, ring)
        for n in LENGTHS:
            h, f = model_cache_bytes(hybrid, dtype, 1, n, ring), model_cache_bytes(full, dtype, 1, n, ring)
            out.append({"model": name, "lookahead": look, "positions": n, "hybrid_bytes": h, "full_attention_bytes": f,
                        "hybrid_state_bytes": model_cache_bytes(hybrid, dtype, 1, 0, ring), "ratio": round(h / f, 4)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    res = rows("Qwen3-Next-80B-A3B (bf16)", QWEN3_NEXT_80B) + rows("tiny (fp32)", TINY)
    if args.json:
        print(json.dumps(res, indent=1))
        return
    print(f"{'model':<26} {'look':>4} {'positions':>9} {'hybrid MiB':>11} {'of it states':>12} "
          f"{'full-attn MiB':>13} ratio")
    for r in res:
        print(f"{r['model']:<26} {r['lookahead']:>4} {r['positions']:>9} {r['hybrid_bytes'] / 2**20:>11.2f} "
              f"{r['hybrid_state_bytes'] / 2**20:>12.2f} {r['full_attention_bytes'] / 2**20:>13.2f} {r['ratio']:.3f}")


if __name__ == "__main__":
    main()
