"""Qwen3.5-MoE as published (`qwen3_5_moe`, Qwen3_5MoeForConditionalGeneration): its language model is
`qwen3_5_moe_text`, read from config.json's `text_config`, its decoder's weights under `model.language_model.`, the
LM head at the top level (`lm_head.weight`, tied as the top-level tie_word_embeddings says). The vision tower
(`model.visual.`) is not loaded, nor the text family's MTP module: text in, text out."""
from __future__ import annotations

from specmoe.families import qwen3_5_moe_text
from specmoe.families.registry import Family, register

FAMILY = register(Family("qwen3_5_moe", "Qwen3.5-MoE (multimodal)", qwen3_5_moe_text.read, partial_rotary_factor=0.25,
                         text_family="qwen3_5_moe_text", weight_prefix="model.language_model.",
                         skipped=("model.visual.",)))
