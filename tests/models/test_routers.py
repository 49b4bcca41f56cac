"""Routers are pure functions checked against the transformers router modules."""
import pytest
import torch

from specmoe.models.routers import route


@pytest.mark.parametrize("family,cls_name,norm", [
    ("mixtral", "transformers.models.mixtral.modeling_mixtral.MixtralTopKRouter", True),
    ("qwen2_moe", "transformers.models.qwen2_moe.modeling_qwen2_moe.Qwen2MoeTopKRouter", False),
    ("qwen3_moe", "transformers.models.qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter", True),
    ("olmoe", "transformers.models.olmoe.modeling_olmoe.OlmoeTopKRouter", False),
])
def test_router_matches_transformers(family, cls_name, norm, tiny_ckpt):
    import importlib

    from transformers import AutoConfig
    mod, cls = cls_name.rsplit(".", 1)
    cfg = AutoConfig.from_pretrained(tiny_ckpt(family))
    ref_router = getattr(importlib.import_module(mod), cls)(cfg)
    torch.manual_seed(0)
    torch.nn.init.normal_(ref_router.weight)
    x = torch.randn(17, cfg.hidden_size)
    out = ref_router(x)
    ref_w, ref_ids = out[1], out[2]
    w, ids = route(family, x @ ref_router.weight.T, top_k=cfg.num_experts_per_tok, norm_topk_prob=norm)
    assert torch.equal(ids, ref_ids)
    assert torch.allclose(w, ref_w.float(), atol=1e-6)
