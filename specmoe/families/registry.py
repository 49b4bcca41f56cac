"""The registry of supported families: `Family` (how one family's config.json differs from the generic
decoder's), `register`, and `family_of(model_type)`. Each family's module under specmoe/families/ registers
itself; `specmoe.families` imports them all."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from specmoe.config import Fields
from specmoe.errors import UnsupportedModelError


@dataclass(frozen=True)
class Shape:
    """What every family reads alike from config.json, handed to a family's reader."""
    vocab_size: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_layers: int
    num_experts: int
    top_k: int
    partial_rotary_factor: float
    rope: dict  # rope_parameters / rope_scaling, or the family's default ({}: plain RoPE)


@dataclass(frozen=True)
class FamilyNames:
    """Where a family's MoE weights sit in its checkpoint (`weights/names.py` builds every key from these)."""
    moe_prefix: str = "mlp"  # "block_sparse_moe" (Mixtral, MiniMax-M2), "feed_forward" (Llama-4) or "mlp"
    expert_proj: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")  # (gate, up, down) inside experts.{e}
    router: str = "gate"     # the router's module name inside the MoE block
    dense_prefix: str = "mlp"  # the dense MLP's module name in a dense layer
    shared: str | None = None  # the shared expert's module name (None: "shared_expert" if gated, else "shared_experts")
    correction_bias: str | None = None  # e_score_correction_bias's name in the MoE block (None: under the router)


# the routers of `models/routers.py` a family may name (`Family.router_kind`)
ROUTER_KINDS = ("softmax-topk", "sigmoid-group-topk", "softmax-group-topk", "topk-softmax", "topk-sigmoid",
                "top2-capacity")


@dataclass(frozen=True)
class Family:
    """One supported architecture. `read(f, shape)` returns the `ModelConfig` fields in which it differs from
    the generic decoder, every value read through `f` (typed, range-checked, a CheckpointError naming the key);
    defaults are the values the family's published checkpoints carry."""
    model_type: str
    name: str  # as its publisher writes it, for messages
    read: Callable[[Fields, Shape], dict]
    experts_key: tuple[str, ...] = ("num_local_experts", "num_experts")  # the routed-expert count's key(s)
    aliases: tuple[str, ...] = ()  # other model_types that are this architecture under their own name
    rope_theta: float = 10000.0  # when config.json has none
    default_rope: dict | None = None  # rope parameters when config.json has none
    yarn: bool = False  # YaRN rope scaling is read (else only plain RoPE)
    partial_rotary_factor: float | None = None  # its default when only part of a head rotates (None: all does)
    quantizations: tuple[str, ...] = ("fp8",)  # quant_methods its quantized checkpoints may use
    llama3_rope: bool = False  # rope_type "llama3" scaling is read
    # where the language model's weights are: `weight_prefix` before the decoder's keys (embed_tokens, layers.*,
    # norm), `head_prefix` before lm_head.weight; the tensors under `skipped` are not loaded (a vision tower and
    # projector, a multi-token-prediction module: parts specmoe does not run)
    weight_prefix: str = "model."
    head_prefix: str = ""
    skipped: tuple[str, ...] = ()
    # a multimodal release of a text family: config.json nests the language model's fields under "text_config"
    # (its model_type `text_family`, whose reader reads them); this family's weight_prefix / head_prefix say where
    # the language model's weights are, its `skipped` adds the vision tower's tensors to the text family's.
    # The LM head's tie (tie_word_embeddings) is read from the config of the module that holds the head: the
    # language model's (text_config) when the head is under it (head_prefix set: Llama-4), else the release's own
    # (a top-level lm_head: Qwen3.5)
    text_family: str | None = None
    # reads the `Shape` itself (config.json names its sizes its own way: NLLB-MoE's d_model, decoder_layers, ...);
    # None: the shared reader (`reader._shape`)
    shape: Callable[[Fields, dict, float], Shape] | None = None
    # its weights' names (MoE block, expert projections, router, shared expert)
    names: FamilyNames = FamilyNames()
    # its router, one of ROUTER_KINDS: softmax then top-k (renormalised where norm_topk_prob), sigmoid or softmax with
    # group-limited top-k (DeepSeek), top-k then softmax (GPT-OSS), top-k then sigmoid (Llama-4), NLLB's top-2 with
    # capacity
    router_kind: str = "softmax-topk"
    # experts stored as one [E, ...] tensor per layer and projection: gate_up_proj [E, D, 2I] with gate and up
    # interleaved column by column (GPT-OSS) or as the first and last I columns (Llama-4); None: per expert
    fused_experts: str | None = None
    # its checkpoints may store experts either way: per expert (what save_pretrained writes) or as transformers'
    # fused [E, 2I, D] gate_up_proj (gate rows first) and [E, D, I] down_proj (Qwen3.5 as published)
    either_layout: bool = False

    def __post_init__(self):
        if self.fused_experts not in (None, "interleaved", "halves"):
            raise ValueError(f"{self.model_type}: fused_experts {self.fused_experts!r} is not interleaved / halves")
        if self.router_kind not in ROUTER_KINDS:
            raise ValueError(f"{self.model_type}: router_kind {self.router_kind!r} is not one of {ROUTER_KINDS}")


FAMILIES: dict[str, Family] = {}  # model_type -> Family, in registration order
ALIASES: dict[str, str] = {}  # alias -> model_type


def register(family: Family) -> Family:
    FAMILIES[family.model_type] = family
    ALIASES.update(dict.fromkeys(family.aliases, family.model_type))
    return family


def families_reading(method: str) -> list[str]:
    """Names of the families whose quantized checkpoints use quant_method `method`."""
    return [f.name for f in FAMILIES.values() if method in f.quantizations]


def family_of(model_type) -> Family:
    """The family a config.json's model_type names (or aliases); UnsupportedModelError listing them if none."""
    mt = ALIASES.get(model_type, model_type) if isinstance(model_type, str) else model_type
    if mt not in FAMILIES:
        raise UnsupportedModelError(f"unsupported model_type {mt!r}; supported: {', '.join(FAMILIES)} "
                                    f"(and {', '.join(ALIASES)})")
    return FAMILIES[mt]
