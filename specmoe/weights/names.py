"""One explicit name map per architecture: which checkpoint key holds which weight,
and the shape it must have. Keys are the ones Hugging Face publishes (per-expert 2-D
tensors), so checkpoints are read exactly as released."""
from __future__ import annotations

from dataclasses import dataclass

from specmoe.config import ModelConfig


@dataclass(frozen=True)
class FamilyNames:
    moe_prefix: str          # "block_sparse_moe" (Mixtral) or "mlp"
    expert_proj: tuple[str, str, str]  # (gate, up, down) projection names inside experts.{e}


FAMILY_NAMES = {
    "mixtral": FamilyNames("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen2_moe": FamilyNames("mlp", ("gate_proj", "up_proj", "down_proj")),
    "qwen3_moe": FamilyNames("mlp", ("gate_proj", "up_proj", "down_proj")),
    "olmoe": FamilyNames("mlp", ("gate_proj", "up_proj", "down_proj")),
}

# Keys some exporters add that carry no weights we need.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def expert_keys(cfg: ModelConfig, layer: int, expert: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{'gate'|'up'|'down': (checkpoint key, shape)} for one expert."""
    n = FAMILY_NAMES[cfg.model_type]
    D, I = cfg.hidden_size, cfg.expert_intermediate_size
    base = f"model.layers.{layer}.{n.moe_prefix}.experts.{expert}"
    g, u, d = n.expert_proj
    return {"gate": (f"{base}.{g}.weight", (I, D)), "up": (f"{base}.{u}.weight", (I, D)),
            "down": (f"{base}.{d}.weight", (D, I))}


def non_expert_keys(cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{module parameter name: (checkpoint key, shape)} for every weight kept resident."""
    D, V = cfg.hidden_size, cfg.vocab_size
    Hq, Hkv, Dh = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    n = FAMILY_NAMES[cfg.model_type]
    out = {"embed.weight": ("model.embed_tokens.weight", (V, D)), "norm.weight": ("model.norm.weight", (D,))}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = ("lm_head.weight", (V, D))
    for i in range(cfg.num_layers):
        p, m = f"model.layers.{i}.", f"layers.{i}."
        out[m + "input_norm.weight"] = (p + "input_layernorm.weight", (D,))
        out[m + "post_attn_norm.weight"] = (p + "post_attention_layernorm.weight", (D,))
        a = p + "self_attn."
        out[m + "attn.q_proj.weight"] = (a + "q_proj.weight", (Hq * Dh, D))
        out[m + "attn.k_proj.weight"] = (a + "k_proj.weight", (Hkv * Dh, D))
        out[m + "attn.v_proj.weight"] = (a + "v_proj.weight", (Hkv * Dh, D))
        out[m + "attn.o_proj.weight"] = (a + "o_proj.weight", (D, Hq * Dh))
        if cfg.qkv_bias:
            out[m + "attn.q_proj.bias"] = (a + "q_proj.bias", (Hq * Dh,))
            out[m + "attn.k_proj.bias"] = (a + "k_proj.bias", (Hkv * Dh,))
            out[m + "attn.v_proj.bias"] = (a + "v_proj.bias", (Hkv * Dh,))
        if cfg.qk_norm == "head":
            out[m + "attn.q_norm.weight"] = (a + "q_norm.weight", (Dh,))
            out[m + "attn.k_norm.weight"] = (a + "k_norm.weight", (Dh,))
        elif cfg.qk_norm == "full":
            out[m + "attn.q_norm.weight"] = (a + "q_norm.weight", (Hq * Dh,))
            out[m + "attn.k_norm.weight"] = (a + "k_norm.weight", (Hkv * Dh,))
        if cfg.is_moe_layer(i):
            mp = p + n.moe_prefix + "."
            out[m + "mlp.router.weight"] = (mp + "gate.weight", (cfg.num_experts, D))
            if cfg.shared_expert_intermediate_size:
                S = cfg.shared_expert_intermediate_size
                out[m + "mlp.shared.gate_proj.weight"] = (mp + "shared_expert.gate_proj.weight", (S, D))
                out[m + "mlp.shared.up_proj.weight"] = (mp + "shared_expert.up_proj.weight", (S, D))
                out[m + "mlp.shared.down_proj.weight"] = (mp + "shared_expert.down_proj.weight", (D, S))
                out[m + "mlp.shared_gate.weight"] = (mp + "shared_expert_gate.weight", (1, D))
        else:
            I = cfg.dense_intermediate_size
            out[m + "mlp.gate_proj.weight"] = (p + "mlp.gate_proj.weight", (I, D))
            out[m + "mlp.up_proj.weight"] = (p + "mlp.up_proj.weight", (I, D))
            out[m + "mlp.down_proj.weight"] = (p + "mlp.down_proj.weight", (D, I))
    return out
