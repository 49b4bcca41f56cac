"""Fixtures: tiny random checkpoints of every supported family, written with
transformers' own classes and `save_pretrained` (real HF key names and layouts)."""
from __future__ import annotations

import pytest
import torch

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


def make_tiny_checkpoint(family: str, path, *, shard_size: str | None = None, seed: int = 0,
                         dtype: torch.dtype = torch.float32, **overrides):
    """Build a random tiny model of `family` with transformers and save it to `path`."""
    import transformers as tf
    common = dict(vocab_size=96, hidden_size=32, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, num_experts_per_tok=2, max_position_embeddings=256,
                  initializer_range=0.2, eos_token_id=None, pad_token_id=None, bos_token_id=None)
    family_kw = {
        "mixtral": dict(intermediate_size=24, num_local_experts=8),
        "qwen2_moe": dict(intermediate_size=40, moe_intermediate_size=24, num_experts=8,
                          shared_expert_intermediate_size=28, norm_topk_prob=False, decoder_sparse_step=1,
                          mlp_only_layers=[1]),
        "qwen3_moe": dict(intermediate_size=40, moe_intermediate_size=24, num_experts=8, head_dim=16,
                          norm_topk_prob=True),
        "olmoe": dict(intermediate_size=24, num_experts=8, clip_qkv=3.0, norm_topk_prob=False),
    }
    classes = {"mixtral": ("MixtralConfig", "MixtralForCausalLM"),
               "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
               "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
               "olmoe": ("OlmoeConfig", "OlmoeForCausalLM")}
    if family not in classes:
        raise ValueError(family)
    cfg = getattr(tf, classes[family][0])(**{**common, **family_kw[family], **overrides})
    cls = getattr(tf, classes[family][1])
    torch.manual_seed(seed)
    model = cls(cfg).to(dtype).eval()
    kw = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(path, **kw)
    return path


@pytest.fixture
def one_thread():
    """Tiny models: one intra-op thread avoids OpenMP oversubscription on a small, shared CPU (two threads
    measured ~10x slower there). Test packages opt in with an autouse fixture that requests this one."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory):
    """tiny_ckpt(family, **overrides) -> path; cached per (family, overrides) for the session."""
    made = {}

    def get(family: str, **overrides):
        key = (family, tuple(sorted(overrides.items())))
        if key not in made:
            d = tmp_path_factory.mktemp(f"tiny_{family}")
            made[key] = make_tiny_checkpoint(family, d, **overrides)
        return made[key]
    return get


@pytest.fixture(scope="session")
def hf_model():
    """hf_model(path) -> the transformers model loaded from a checkpoint dir (fp32, eval)."""
    from transformers import AutoModelForCausalLM
    cache = {}

    def get(path):
        if path not in cache:
            cache[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return cache[path]
    return get


def pytest_collection_modifyitems(config, items):
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="CUDA not available")
        for item in items:
            if "cuda" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _user_cache(tmp_path_factory):
    """The cost model's calibration cache ($XDG_CACHE_HOME/specmoe) goes to a session temp dir, never the
    user's."""
    import os
    old = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(tmp_path_factory.mktemp("xdg_cache"))
    yield
    if old is None:
        os.environ.pop("XDG_CACHE_HOME", None)
    else:
        os.environ["XDG_CACHE_HOME"] = old
