"""The supported families and the reader of their config.json.

Every family is a delta of the one generic decoder (specmoe/models/): its module here says how its
config.json differs (`Family.read` returns the `ModelConfig` fields it sets) and registers it by model_type;
`read_config` / `load_config` (reader.py) read what all families share and look the rest up by model_type.
Shared pieces (YaRN, latent attention, group-limited routing, ...) are in parts.py, quantized checkpoints in
quantization.py. A new family is one module here, and its import below.
"""
from __future__ import annotations

# each module registers its family, in this order (the order messages list them in)
from specmoe.families import (mixtral, qwen2_moe, qwen3_moe, olmoe, glm4_moe, deepseek_v2,  # noqa: F401,I001
                              deepseek_v3, gpt_oss, llama4_text, llama4, minimax_m2, nllb_moe, qwen3_next,
                              qwen3_5_moe_text, qwen3_5_moe)
from specmoe.families.reader import load_config, read_config
from specmoe.families.registry import ALIASES, FAMILIES, Family, family_of

__all__ = ["ALIASES", "FAMILIES", "Family", "family_of", "load_config", "read_config"]
