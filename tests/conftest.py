"""Fixtures: tiny random checkpoints of every supported family, written with
transformers' own classes and `save_pretrained` (real HF key names and layouts)."""
from __future__ import annotations

import pytest
import torch

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
# Families built as deltas of the generic decoder; tested in tests/models/test_families.py (their own, compact
# matrix: the FAMILIES matrices above would multiply the suite's time)
DELTA_FAMILIES = ("glm4_moe", "deepseek_v2", "deepseek_v3", "gpt_oss")


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
        # odd sizes; 8 experts in 4 groups, 2 groups eligible, top-3; one dense first layer; 2 shared experts
        "glm4_moe": dict(hidden_size=36, intermediate_size=44, moe_intermediate_size=20, n_routed_experts=8,
                         num_experts_per_tok=3, n_group=4, topk_group=2, n_shared_experts=2, first_k_dense_replace=1,
                         routed_scaling_factor=1.5, head_dim=12, attention_bias=True, use_qk_norm=True,
                         num_nextn_predict_layers=0),
        # MLA with odd ranks, YaRN with distinct mscales (so both the cos/sin factor and the softmax scale move)
        "deepseek_v3": dict(hidden_size=40, num_attention_heads=4, num_key_value_heads=4, intermediate_size=44,
                            moe_intermediate_size=20, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
                            topk_group=2, first_k_dense_replace=1, n_shared_experts=1, routed_scaling_factor=2.5,
                            q_lora_rank=24, kv_lora_rank=12, qk_rope_head_dim=8, qk_nope_head_dim=6, v_head_dim=10,
                            num_nextn_predict_layers=0,
                            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                             "original_max_position_embeddings": 64, "beta_fast": 32.0,
                                             "beta_slow": 1.0, "mscale": 0.9, "mscale_all_dim": 0.7}),
        # V2-Lite style (no q LoRA), group-limited softmax routing, no dense layer, YaRN
        "deepseek_v2": dict(hidden_size=40, num_attention_heads=4, num_key_value_heads=4, intermediate_size=44,
                            moe_intermediate_size=20, n_routed_experts=8, num_experts_per_tok=3, n_group=4,
                            topk_group=2, topk_method="group_limited_greedy", first_k_dense_replace=0,
                            n_shared_experts=2, routed_scaling_factor=1.7, q_lora_rank=None, kv_lora_rank=12,
                            qk_rope_head_dim=8, qk_nope_head_dim=6, v_head_dim=10,
                            rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                             "original_max_position_embeddings": 64, "beta_fast": 32.0,
                                             "beta_slow": 1.0, "mscale": 0.8, "mscale_all_dim": 0.8}),
        # sliding window 3 on layers 0 and 2; a low swiglu_limit so the clamp acts at this init scale
        "gpt_oss": dict(hidden_size=36, num_attention_heads=4, num_key_value_heads=2, head_dim=10,
                        intermediate_size=20, num_local_experts=8, num_experts_per_tok=3, sliding_window=3,
                        swiglu_limit=0.5,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0,
                                         "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                                         "original_max_position_embeddings": 64}),
    }
    classes = {"mixtral": ("MixtralConfig", "MixtralForCausalLM"),
               "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
               "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
               "olmoe": ("OlmoeConfig", "OlmoeForCausalLM"),
               "glm4_moe": ("Glm4MoeConfig", "Glm4MoeForCausalLM"),
               "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
               "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM"),
               "gpt_oss": ("GptOssConfig", "GptOssForCausalLM")}
    if family not in classes:
        raise ValueError(family)
    cfg = getattr(tf, classes[family][0])(**{**common, **family_kw[family], **overrides})
    cls = getattr(tf, classes[family][1])
    torch.manual_seed(seed)
    model = cls(cfg).to(dtype).eval()
    if family in DELTA_FAMILIES or overrides.get("attention_bias"):  # biases, correction biases and sinks start
        # at zero: make them matter
        with torch.no_grad():
            for name, t in model.state_dict().items():
                if not t.any() or name.endswith("sinks"):
                    t.normal_(0.0, 0.5 if name.endswith(("e_score_correction_bias", "sinks")) else 0.2)
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


@pytest.fixture
def torch_path():
    """The torch matmul path for this test (the native CPU kernels off; restored after): for tests of what the torch
    path does (its weight-major products, its row padding) and for equality tests run on both paths."""
    from specmoe import kernels
    was = kernels.available()
    if was:
        kernels.set_enabled(False)
    yield
    if was:
        kernels.set_enabled(True)


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
