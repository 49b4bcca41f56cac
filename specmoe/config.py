"""Model configuration read raw from a Hugging Face config.json.

One dataclass for every supported family; per-family differences are plain fields
(`qk_norm`, `shared_expert_intermediate_size`, ...) filled by `ModelConfig.from_hf`.
Class defaults of transformers are never trusted: every key is read from the file
with the default the family's published checkpoints imply.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from specmoe.errors import CheckpointError, UnsupportedModelError

SUPPORTED_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    dense_intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    norm_topk_prob: bool = True
    qk_norm: str | None = None  # None | "head" (Qwen3: per head) | "full" (OLMoE: whole projection)
    qkv_bias: bool = False
    clip_qkv: float | None = None
    sliding_window: int | None = None
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE shared expert (0 = none)
    moe_layers: tuple[int, ...] = field(default_factory=tuple)  # which layers are sparse
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"  # dtype the checkpoint was saved in

    def __post_init__(self):
        if not self.moe_layers:
            self.moe_layers = tuple(range(self.num_layers))
        assert self.num_heads % self.num_kv_heads == 0, "num_attention_heads must be a multiple of num_key_value_heads"
        assert self.top_k <= self.num_experts, "num_experts_per_tok exceeds the number of experts"

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    @property
    def expert_numel(self) -> int:
        """Elements of one expert packed as [gate; up; down] (3 · I · D)."""
        return 3 * self.expert_intermediate_size * self.hidden_size

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        cfg_path = path / "config.json"
        if not path.is_dir():
            raise CheckpointError(f"model directory not found: {path}")
        if not cfg_path.is_file():
            raise CheckpointError(f"missing config.json in {path}")
        try:
            raw = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"config.json in {path} is not valid JSON: {e}") from None
        gen = path / "generation_config.json"
        gen_raw = {}
        if gen.is_file():
            try:
                gen_raw = json.loads(gen.read_text())
            except json.JSONDecodeError:
                gen_raw = {}
        return cls.from_hf(raw, generation_config=gen_raw)

    @classmethod
    def from_hf(cls, raw: dict, generation_config: dict | None = None) -> "ModelConfig":
        mt = raw.get("model_type")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"unsupported model_type {mt!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")

        def need(*keys):
            for k in keys:
                if raw.get(k) is not None:
                    return raw[k]
            raise CheckpointError(f"config.json lacks {' / '.join(keys)} (model_type {mt})")

        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise UnsupportedModelError(f"rope type {rope_type!r} is not supported yet (only default RoPE)")
        rope_theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        if rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) != 1.0:
            raise UnsupportedModelError("partial rotary embeddings are not supported")

        H = need("hidden_size")
        n_heads = need("num_attention_heads")
        n_kv = raw.get("num_key_value_heads") or n_heads
        head_dim = raw.get("head_dim") or H // n_heads
        L = need("num_hidden_layers")
        E = need("num_local_experts", "num_experts")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only silu)")

        kw: dict = {}
        if mt == "mixtral":
            kw.update(expert_intermediate_size=need("intermediate_size"), dense_intermediate_size=0,
                      norm_topk_prob=True, sliding_window=raw.get("sliding_window"))
        elif mt in ("qwen2_moe", "qwen3_moe"):
            step = raw.get("decoder_sparse_step", 1) or 1
            mlp_only = set(raw.get("mlp_only_layers") or [])
            moe_layers = tuple(i for i in range(L) if i not in mlp_only and E > 0 and (i + 1) % step == 0)
            kw.update(expert_intermediate_size=need("moe_intermediate_size"),
                      dense_intermediate_size=raw.get("intermediate_size") or 0,
                      norm_topk_prob=bool(raw.get("norm_topk_prob", False)), moe_layers=moe_layers)
            if raw.get("use_sliding_window"):
                raise UnsupportedModelError(f"{mt} with use_sliding_window=true is not supported yet")
            if mt == "qwen2_moe":
                kw.update(qkv_bias=bool(raw.get("qkv_bias", True)),
                          shared_expert_intermediate_size=raw.get("shared_expert_intermediate_size") or 0)
            else:
                kw.update(qk_norm="head", qkv_bias=bool(raw.get("attention_bias", False)))
        elif mt == "olmoe":
            kw.update(expert_intermediate_size=need("intermediate_size"), dense_intermediate_size=0,
                      norm_topk_prob=bool(raw.get("norm_topk_prob", False)), qk_norm="full",
                      qkv_bias=bool(raw.get("attention_bias", False)), clip_qkv=raw.get("clip_qkv"))
            if head_dim != H // n_heads:
                raise UnsupportedModelError("OLMoE with head_dim != hidden_size / num_attention_heads")

        eos = (generation_config or {}).get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        eos_ids = tuple(e for e in eos_ids if 0 <= e < raw.get("vocab_size", 0))
        dtype = str(raw.get("dtype") or raw.get("torch_dtype") or "float32")
        return cls(model_type=mt, vocab_size=need("vocab_size"), hidden_size=H, num_layers=L, num_heads=n_heads,
                   num_kv_heads=n_kv, head_dim=head_dim, num_experts=E, top_k=need("num_experts_per_tok"),
                   rms_norm_eps=raw.get("rms_norm_eps", 1e-6), rope_theta=float(rope_theta),
                   max_position_embeddings=raw.get("max_position_embeddings", 4096),
                   tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)), hidden_act=act,
                   bos_token_id=raw.get("bos_token_id"), eos_token_ids=eos_ids, dtype=dtype, **kw)
