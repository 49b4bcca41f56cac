"""Llama-4's multimodal release (`llama4`, Llama4ForConditionalGeneration): its language model is `llama4_text`,
read from config.json's text_config, its weights under `language_model.` (the decoder's `language_model.model.*`,
the LM head `language_model.lm_head.weight`, tied as text_config says); the vision tower (`vision_model.`) and the
projector (`multi_modal_projector.`) are not loaded (a one-line warning says so): specmoe runs text."""
from __future__ import annotations

from specmoe.families import llama4_text
from specmoe.families.registry import Family, register

FAMILY = register(Family("llama4", "Llama-4 (multimodal)", llama4_text.read, experts_key=("num_local_experts",),
                         quantizations=(), text_family="llama4_text", weight_prefix="language_model.model.",
                         head_prefix="language_model.",
                         skipped=("vision_model.", "multi_modal_projector.")))
