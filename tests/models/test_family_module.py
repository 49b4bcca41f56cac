"""A family is its module: what the engine needs of one (config reader, weight names, router, expert layout) is
declared by its `Family` (specmoe/families/<family>.py), so registering one is all a new family takes."""
from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import torch

from specmoe import LLM
from specmoe.families import registry
from specmoe.families.mixtral import FAMILY as MIXTRAL
from specmoe.families.gpt_oss import FAMILY as GPT_OSS


def _renamed(src: Path, dst: Path, model_type: str) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg["model_type"] = model_type
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_a_family_registered_from_one_object_reads_names_and_routes_like_its_original(tiny_ckpt, tmp_path,
                                                                                      monkeypatch):
    """Mixtral's and GPT-OSS's Family objects registered under new model_types (nothing else in specmoe told):
    checkpoints of those types load and score exactly as the originals (Mixtral's block_sparse_moe names and w1/w3/w2
    projections, GPT-OSS's fused interleaved experts, its "router" module and top-k-then-softmax routing all come
    from the Family)."""
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    for fam, src in ((MIXTRAL, tiny_ckpt("mixtral")), (GPT_OSS, tiny_ckpt("gpt_oss"))):
        new = f"{fam.model_type}_renamed"
        monkeypatch.setitem(registry.FAMILIES, new, dataclasses.replace(fam, model_type=new, aliases=()))
        dst = _renamed(Path(src), tmp_path / new, new)
        llm = LLM(str(dst), dtype="float32")
        assert llm.config.model_type == new
        assert torch.equal(llm.logits(prompts), LLM(str(src), dtype="float32").logits(prompts))
    # and the declaration is what is read: a wrong router kind in the Family changes the scores
    wrong = dataclasses.replace(MIXTRAL, model_type="mixtral_wrong_router", router_kind="topk-sigmoid", aliases=())
    monkeypatch.setitem(registry.FAMILIES, "mixtral_wrong_router", wrong)
    dst = _renamed(Path(tiny_ckpt("mixtral")), tmp_path / "wrong", "mixtral_wrong_router")
    assert not torch.equal(LLM(str(dst), dtype="float32").logits(prompts),
                           LLM(tiny_ckpt("mixtral"), dtype="float32").logits(prompts))
