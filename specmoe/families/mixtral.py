"""Mixtral: the generic decoder as it is (softmax top-k router, renormalised), an optional sliding window."""
from __future__ import annotations

from specmoe.config import Fields
from specmoe.families.registry import Family, FamilyNames, Shape, register


def read(f: Fields, shape: Shape) -> dict:
    return {"expert_intermediate_size": f.int("intermediate_size"), "dense_intermediate_size": 0,
            "norm_topk_prob": True, "sliding_window": f.int("sliding_window", default=None)}


FAMILY = register(Family("mixtral", "Mixtral", read, names=FamilyNames("block_sparse_moe", ("w1", "w3", "w2"))))
