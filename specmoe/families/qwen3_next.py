"""Qwen3-Next: hybrid attention (Gated DeltaNet linear attention in 3 of 4 layers, gated full attention in the
rest), zero-centred RMSNorms, partial rotary, Qwen's sparse-layer layout with a sigmoid-gated shared expert.
The multi-token-prediction weights (`mtp.*`) are not used."""
from __future__ import annotations

from specmoe.config import Fields
from specmoe.families.parts import qwen_hybrid, qwen_moe
from specmoe.families.registry import Family, Shape, register


def read(f: Fields, shape: Shape) -> dict:
    return {**qwen_moe(f, shape.num_layers, "qwen3_next"), "norm_topk_prob": f.bool("norm_topk_prob", True),
            "shared_expert_intermediate_size": f.int("shared_expert_intermediate_size", default=0, lo=0),
            **qwen_hybrid(f, shape, split_projections=False)}


FAMILY = register(Family("qwen3_next", "Qwen3-Next", read, partial_rotary_factor=0.25,
                         skipped=("mtp.",), either_layout=True))
