"""Tiny random Llama-4 and MiniMax-M2 checkpoints, written by transformers' own classes with `save_pretrained`
(real key names and layouts), and the matching transformers model to compare against.

Variants (odd sizes everywhere):
- "llama4": Llama4ForCausalLM, 5 layers: dense 0, 2, 4 and MoE 1, 3 (interleave step 2); NoPE layers 1 (MoE) and
  4 (dense) with attention temperature tuning (floor_scale 3, so it moves within a few positions); chunked attention
  (chunk 5) with the L2 q/k norm on the rotary layers 0, 2, 3; llama3 rope scaling with every frequency regime;
  7 experts, top-1.
- "llama4_top2": another seed, every layer MoE, top-2, no q/k norm, no temperature tuning, plain rope, chunk 4.
- "llama4_mm": the multimodal Llama4ForConditionalGeneration (tiny vision tower), "llama4"'s text config.
- "minimax_m2": MiniMaxM2ForCausalLM, 3 layers, 8 experts top-3, rotary_dim 6 of head_dim 10, and a seed 1 twin.
Zero-initialised tensors (the correction bias) and the all-ones norm weights are randomised so they matter.
"""
from __future__ import annotations

from pathlib import Path

import pytest

import torch

from specmoe import SamplingParams

NEW_FAMILIES = ("llama4", "minimax_m2")  # one checkpoint per family for the engine-level matrices
VARIANTS = ("llama4", "llama4_top2", "llama4_mm", "minimax_m2", "minimax_m2_s1")

_COMMON = dict(vocab_size=96, hidden_size=36, num_attention_heads=4, num_key_value_heads=2, head_dim=10,
               max_position_embeddings=256, initializer_range=0.2, eos_token_id=None, pad_token_id=None,
               bos_token_id=None)
LLAMA4 = dict(_COMMON, num_hidden_layers=5, intermediate_size=20, intermediate_size_mlp=44, num_local_experts=7,
              num_experts_per_tok=1, interleave_moe_layer_step=2, no_rope_layers=[1, 0, 1, 1, 0],
              attention_chunk_size=5, attn_temperature_tuning=True, floor_scale=3, attn_scale=0.3, use_qk_norm=True,
              rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
                               "high_freq_factor": 4.0, "original_max_position_embeddings": 128})
LLAMA4_TOP2 = dict(_COMMON, num_hidden_layers=3, intermediate_size=18, intermediate_size_mlp=30,
                   num_local_experts=6, num_experts_per_tok=2, interleave_moe_layer_step=1,
                   no_rope_layers=[1, 0, 1], attention_chunk_size=4, attn_temperature_tuning=False,
                   use_qk_norm=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
MINIMAX_M2 = dict(_COMMON, num_hidden_layers=3, intermediate_size=20, num_local_experts=8, num_experts_per_tok=3,
                  rotary_dim=6)
VISION = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, vision_output_dim=16,
              image_size=28, patch_size=14, projector_input_dim=16, projector_output_dim=16)


def build(variant: str, seed: int | None = None, **overrides):
    """The transformers model of `variant` (random, eval, fp32)."""
    import transformers as tf
    if variant in ("llama4", "llama4_top2"):
        cfg = tf.Llama4TextConfig(**{**(LLAMA4 if variant == "llama4" else LLAMA4_TOP2), **overrides})
        cls, default_seed = tf.Llama4ForCausalLM, 0 if variant == "llama4" else 1
    elif variant == "llama4_mm":
        cfg = tf.Llama4Config(text_config={**LLAMA4, **overrides}, vision_config=VISION)
        cls, default_seed = tf.Llama4ForConditionalGeneration, 2
    elif variant in ("minimax_m2", "minimax_m2_s1"):
        cfg = tf.MiniMaxM2Config(**{**MINIMAX_M2, **overrides})
        cls, default_seed = tf.MiniMaxM2ForCausalLM, 0 if variant == "minimax_m2" else 1
    else:
        raise ValueError(variant)
    torch.manual_seed(default_seed if seed is None else seed)
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, t in model.state_dict().items():
            if name.endswith("e_score_correction_bias") or not t.any():
                t.normal_(0.0, 0.5)
            elif name.endswith("norm.weight"):
                t.add_(torch.randn_like(t) * 0.2)
    return model


def make(variant: str, path: Path, dtype: torch.dtype = torch.float32, **overrides) -> Path:
    model = build(variant, **overrides)
    (model if dtype == torch.float32 else model.to(dtype)).save_pretrained(path)
    return path


def load_hf(path: Path):
    """transformers' model of a saved variant (fp32, eval). For model_type llama4, the language model of the
    multimodal class as it loads the checkpoint (its own text-only forward fails in transformers 5.24:
    `MoeCausalLMOutputWithPast` has no `image_outputs`)."""
    import json

    import transformers as tf
    if json.loads((Path(path) / "config.json").read_text())["model_type"] == "llama4":
        return tf.Llama4ForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval().language_model
    return tf.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


_MADE: dict = {}


def checkpoint(variant: str, tmp_path_factory, dtype: torch.dtype = torch.float32, **overrides) -> Path:
    """A saved variant, made once per session (tmp_path_factory: pytest's session fixture)."""
    key = (variant, dtype, repr(sorted(overrides.items())))
    if key not in _MADE:
        _MADE[key] = make(variant, tmp_path_factory.mktemp(variant), dtype, **overrides)
    return _MADE[key]


# shared by the Llama-4 and MiniMax-M2 test modules (imported there, fixtures included)
# the longest prompt spans three attention chunks of 5 (and four of 4)
PROMPTS = [[5, 9, 3, 7, 2, 8, 11, 40, 1, 17, 60, 33, 90, 4], [4, 6, 10], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22],
           [30]]
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return lambda variant, **kw: checkpoint(variant, tmp_path_factory, **kw)
