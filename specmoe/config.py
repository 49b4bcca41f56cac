"""The model configuration: one dataclass for every supported family, and the typed JSON reads it is built with.

Per-family differences are plain fields of `ModelConfig` (`qk_norm`, `shared_expert_intermediate_size`, `mla`,
`yarn`, `attention_sinks`, ...), filled from a Hugging Face config.json by `specmoe.families.read_config` /
`load_config` (each family's module there reads its own fields). Every value is checked for its type and range
(`Fields`), so nothing downstream meets an unchecked value; a bad one is a CheckpointError naming the file, the
field and what was expected.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from specmoe.errors import CheckpointError

FLOAT_DTYPES = ("float32", "float16", "bfloat16")  # what a checkpoint may declare (torch_dtype / dtype)
_MISSING = object()


def type_name(v) -> str:
    return "null" if v is None else {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
                                     list: "a list", dict: "an object"}.get(type(v), type(v).__name__)


def read_json_object(path: Path, error=CheckpointError) -> dict:
    """A JSON file that must hold an object: unreadable, non-UTF-8, invalid JSON or another shape
    (a list, null, a number) is one `error` naming the file."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise error(f"cannot read {path}: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{path} is not UTF-8 text (invalid byte at offset {e.start})") from None
    try:
        obj = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as e:
        raise error(f"{path} is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise error(f"{path} must hold a JSON object, got {type_name(obj)}")
    return obj


class Fields:
    """Typed reads of one JSON object; every failure names `source` and the key."""

    def __init__(self, raw: dict, source: str):
        self.raw, self.source = raw, source

    def fail(self, key: str, expected: str, value=_MISSING):
        got = "it is missing" if value is _MISSING else f"got {value!r}"
        raise CheckpointError(f"{self.source}: {key} must be {expected}; {got}")

    def first(self, *keys):
        """(key, value) of the first key present and not null, else (keys[0], _MISSING)."""
        for k in keys:
            if self.raw.get(k) is not None:
                return k, self.raw[k]
        return keys[0], _MISSING

    def int(self, *keys, default=_MISSING, lo: int = 1, hi: int | None = None):
        k, v = self.first(*keys)
        name = " / ".join(keys)
        if v is _MISSING:
            if default is _MISSING:
                self.fail(name, f"an integer >= {lo}")
            return default
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        if type(v) is not int or v < lo or (hi is not None and v > hi):
            self.fail(k, f"an integer {rng}", v)
        return v

    def float(self, key: str, default, *, positive: bool = True, value=_MISSING):
        v = self.raw.get(key) if value is _MISSING else value
        if v is None:
            return default
        if type(v) not in (int, float) or not math.isfinite(v) or (positive and v <= 0):
            self.fail(key, "a finite number" + (" > 0" if positive else ""), v)
        return float(v)

    def bool(self, key: str, default: bool) -> bool:
        v = self.raw.get(key)
        if v is None:
            return default
        if type(v) is not bool:
            self.fail(key, "true or false", v)
        return v

    def str(self, key: str, default: str) -> str:
        v = self.raw.get(key)
        if v is None:
            return default
        if type(v) is not str:
            self.fail(key, "a string", v)
        return v

    def token_ids(self, key: str, vocab: int) -> tuple[int, ...]:
        """An id, a list of ids, or null; ids outside [0, vocab) are dropped (some exporters write -1)."""
        v = self.raw.get(key)
        ids = v if isinstance(v, list) else ([] if v is None else [v])
        if any(type(t) is not int for t in ids):
            self.fail(key, "a token id, a list of token ids, or null", v)
        return tuple(t for t in ids if 0 <= t < vocab)


@dataclass(frozen=True)
class Yarn:
    """YaRN RoPE scaling, as transformers reads `rope_parameters` (rope_type "yarn")."""
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None  # scales cos/sin; None: derived from factor (and the mscales)
    truncate: bool = True


@dataclass(frozen=True)
class Llama3Rope:
    """Llama-3-style RoPE scaling (rope_type "llama3", Llama-4's release): frequencies whose wavelength exceeds
    original_max_position_embeddings / low_freq_factor are divided by `factor`, those under
    original_max_position_embeddings / high_freq_factor kept, the ones between interpolated smoothly."""
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class MLA:
    """Multi-head latent attention sizes (DeepSeek-V2/V3). q_lora_rank None: a plain q_proj."""
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class Quantization:
    """A checkpoint that ships quantized weights (config.json `quantization_config`), read as stored:
    `mxfp4` (GPT-OSS): each expert projection as FP4 e2m1 blocks of 32 values (`*_blocks`, uint8, two per byte)
    with one e8m0 exponent per block (`*_scales`, uint8); everything else floating point.
    `fp8` (DeepSeek-V3, and other families' fine-grained FP8 releases): linear weights as float8_e4m3fn with one
    fp32 multiplier per `block` of rows x columns (`<name>.weight_scale_inv`); experts always, other linears where
    their tensor is fp8 (norms, embeddings, routers stay floating point)."""
    method: str  # "mxfp4" | "fp8"
    block: tuple[int, int] = (128, 128)  # fp8: weight_block_size (rows, columns)


@dataclass(frozen=True)
class LinearAttention:
    """Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5): key heads of k_head_dim, value heads of v_head_dim
    (num_v_heads a multiple of num_k_heads, each key head serving num_v_heads / num_k_heads value heads), a causal
    depthwise conv of conv_kernel taps over q, k and v. `split_projections`: the checkpoint stores in_proj_qkv /
    in_proj_z / in_proj_b / in_proj_a (Qwen3.5) rather than in_proj_qkvz / in_proj_ba grouped per key head
    (Qwen3-Next)."""
    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int
    split_projections: bool = False

    @property
    def conv_dim(self) -> int:
        """Channels of the conv (and of its state): q and k (num_k_heads · k_head_dim each) and v."""
        return 2 * self.num_k_heads * self.k_head_dim + self.num_v_heads * self.v_head_dim


@dataclass(frozen=True)
class Capacity:
    """NLLB-MoE's expert capacity in eval (transformers' `NllbMoeTop2Router.route_tokens`): over a group of N tokens
    an expert takes at most C = ceil(`fraction` · N) assignments (`fraction` <= 0: `expert_capacity`), first
    choices before second ones, in token order (`batch_prioritized`: most confident tokens first); an assignment
    past C is dropped. `normalize_before_dropping`: the two weights are normalised before the drop (else after,
    over what is kept)."""
    fraction: float = 1.0
    expert_capacity: int | None = None
    batch_prioritized: bool = False
    normalize_before_dropping: bool = False

    def limit(self, n: int, num_experts: int) -> int:
        if self.fraction > 0:
            return math.ceil(self.fraction * n)
        return self.expert_capacity if self.expert_capacity is not None else 2 * math.ceil(n / num_experts)


@dataclass(frozen=True)
class Seq2Seq:
    """An encoder–decoder model (NLLB-MoE, M2M100-style): the encoder's own sizes (the `ModelConfig` sizes are the
    decoder's), scaled embeddings, sinusoidal positions offset by the padding id, the decoder's start token, and the
    expert capacity rule of the encoder's MoE layers. Layers are numbered encoder first: encoder layer i is layer i,
    decoder layer j is layer `encoder_layers` + j (`ModelConfig.moe_layers` counts both stacks)."""
    encoder_layers: int
    encoder_heads: int
    encoder_ffn: int  # the encoder's dense FFN width (its experts' is `expert_intermediate_size`)
    pad_token_id: int
    decoder_start_token_id: int
    embed_scale: float
    capacity: Capacity
    layer_norm_eps: float = 1e-5


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
    # None | "head" (Qwen3: per head) | "full" (OLMoE, MiniMax-M2: whole projection) | "l2" (Llama-4: per head,
    # no weight, after the rotation, on the rotary layers only)
    qk_norm: str | None = None
    qkv_bias: bool = False
    clip_qkv: float | None = None
    sliding_window: int | None = None
    shared_expert_intermediate_size: int = 0  # shared expert(s) next to the routed ones (0 = none)
    shared_expert_gate: bool = True  # Qwen2-MoE: sigmoid gate on the shared expert; GLM-4 / DeepSeek: none
    moe_layers: tuple[int, ...] = field(default_factory=tuple)  # which layers are sparse
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"  # dtype the checkpoint was saved in
    # --- RoPE
    rope_dim: int = 0  # dims of a head that rotate (0 = head_dim); GLM-4: partial_rotary_factor · head_dim
    rope_interleave: bool = False  # DeepSeek, Llama-4: rotary pairs stored interleaved (x0, x1), (x2, x3), ...
    yarn: Yarn | None = None  # YaRN RoPE scaling (DeepSeek-V3, GPT-OSS); None = plain RoPE
    # --- attention
    mla: MLA | None = None  # DeepSeek multi-head latent attention (None = standard GQA attention)
    o_proj_bias: bool = False  # GPT-OSS
    attention_sinks: bool = False  # GPT-OSS: a learned per-head logit that joins every softmax
    sliding_layers: tuple[int, ...] | None = None  # layers using sliding_window (None: all of them)
    attn_output_gate: bool = False  # Qwen3-Next / Qwen3.5: q_proj also yields a per-head gate, out · σ(gate)
    # --- linear attention (hybrid models: these layers mix tokens with a recurrent state instead of a KV cache)
    linear_attention: LinearAttention | None = None
    linear_layers: tuple[int, ...] = ()  # layers with Gated DeltaNet linear attention (the rest: full attention)
    # --- norms
    norm_offset: bool = False  # zero-centred RMSNorm: the stored weight w scales by (1 + w) (Qwen3-Next, Qwen3.5)
    # --- routing (the rule itself is per family: models/routers.py)
    router_bias: bool = False  # GPT-OSS: the router linear has a bias
    score_correction_bias: bool = False  # GLM-4 / DeepSeek-V3: e_score_correction_bias picks, weights don't use it
    n_group: int = 1  # group-limited top-k: experts in n_group groups, only topk_group groups eligible
    topk_group: int = 1
    routed_scaling_factor: float = 1.0  # routed experts' weights are multiplied by this
    # --- experts
    expert_bias: bool = False  # GPT-OSS: gate/up and down biases packed after the weights
    # "swiglu": gate, up, down (every decoder-only family); "relu": one input projection (fc1), ReLU, fc2 (NLLB-MoE)
    expert_act: str = "swiglu"
    swiglu_limit: float | None = None  # GPT-OSS clamped SwiGLU: (clamp(up) + 1) · g·σ(α·g), g = min(gate, limit)
    swiglu_alpha: float = 1.702
    extra_layers: int = 0  # multi-token-prediction layers stored after the last layer (not used, not loaded)
    # --- storage
    quantization: Quantization | None = None  # weights shipped quantized (read as stored; None: floating point)
    # where the weights are: `weight_prefix` before the decoder's keys (embed_tokens, layers.*, norm), `head_prefix`
    # before lm_head.weight (a multimodal release: Llama-4 "language_model.model." / "language_model.", Qwen3.5
    # "model.language_model." / ""); keys under `skipped_prefixes` are not loaded (a vision tower and projector,
    # a multi-token-prediction module)
    weight_prefix: str = "model."
    head_prefix: str = ""
    skipped_prefixes: tuple[str, ...] = ()
    fused_experts: bool = False  # experts stored as [E, 2I, D] gate_up_proj / [E, D, I] down_proj per layer (set by
    # the Checkpoint from its keys: transformers' own layout, as Qwen3.5 publishes it)
    # --- Llama-4
    llama3_rope: Llama3Rope | None = None  # rope_type "llama3" frequency scaling (None: none)
    nope_layers: tuple[int, ...] = ()  # layers without rotary embeddings (Llama-4's NoPE layers)
    attention_chunk_size: int | None = None  # chunked local attention: a query sees only keys of its chunk
    chunked_layers: tuple[int, ...] = ()  # the layers attention_chunk_size applies to
    # NoPE layers scale each query by log1p(floor((p + 1) / floor_scale)) · attn_scale + 1 at position p
    # (attention temperature tuning); None: off
    attn_floor_scale: float | None = None
    attn_scale: float = 0.1
    routed_input_scaled: bool = False  # Llama-4: the routing weight scales the expert's input, not its output
    # --- encoder–decoder (NLLB-MoE); None: decoder-only
    seq2seq: Seq2Seq | None = None

    def __post_init__(self):
        if not self.moe_layers:
            self.moe_layers = tuple(range(self.decoder_layer0, self.decoder_layer0 + self.num_layers))
        if self.sliding_layers is None:
            self.sliding_layers = tuple(range(self.num_layers))
        # the reader checks these with the file's field names; direct construction gets the same guarantees
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise CheckpointError("config.json: num_attention_heads must be a multiple of num_key_value_heads; "
                                  f"got {self.num_heads} and {self.num_kv_heads}")
        if not 1 <= self.top_k <= self.num_experts:
            raise CheckpointError(f"config.json: num_experts_per_tok must be in [1, {self.num_experts}] "
                                  f"(the number of experts); got {self.top_k}")

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    @property
    def attention_layers(self) -> tuple[int, ...]:
        """Layers with (full or sliding-window) attention: the layers the KV cache holds."""
        return tuple(i for i in range(self.num_layers) if i not in self.linear_layers)

    def cache_index(self, layer: int) -> int:
        """`layer`'s row in the cache of its kind: the KV cache (attention layers) or the linear-attention
        state cache (linear layers)."""
        kind = self.linear_layers if layer in self.linear_layers else self.attention_layers
        return kind.index(layer)

    def chunk(self, layer: int) -> int | None:
        """The attention chunk of `layer` (None: not chunked): keys visible only within the query's chunk."""
        return self.attention_chunk_size if layer in self.chunked_layers else None

    def rotary(self, layer: int) -> bool:
        """Whether `layer` applies rotary embeddings (False: a NoPE layer)."""
        return layer not in self.nope_layers

    @property
    def decoder_layer0(self) -> int:
        """The global index of the decoder's first layer (0 for a decoder-only model; see `Seq2Seq`)."""
        return self.seq2seq.encoder_layers if self.seq2seq is not None else 0

    @property
    def draft_layers(self) -> tuple[int, ...]:
        """The MoE layers a draft forward runs through: all of them, or an encoder–decoder model's decoder ones (the
        encoder runs once per request and is never drafted, so it pins no draft experts)."""
        return tuple(layer for layer in self.moe_layers if layer >= self.decoder_layer0)

    def capacity(self, layer: int) -> Capacity | None:
        """The expert capacity rule of MoE layer `layer` (NLLB-MoE's encoder layers), None: none."""
        s = self.seq2seq
        return s.capacity if s is not None and layer < s.encoder_layers else None

    @property
    def gated_experts(self) -> bool:
        return self.expert_act == "swiglu"

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer`'s attention (None: full causal attention)."""
        return self.sliding_window if self.sliding_window and layer in self.sliding_layers else None

    @property
    def expert_numel(self) -> int:
        """Elements of one expert packed as [gate; up; down] (3 · I · D), then, with expert biases,
        [gate bias (I); up bias (I); down bias (D)]."""
        I, D = self.expert_intermediate_size, self.hidden_size
        if not self.gated_experts:  # [fc1 (I·D); fc2 (D·I)] (+ [fc1 bias (I); fc2 bias (D)])
            return 2 * I * D + (I + D if self.expert_bias else 0)
        return 3 * I * D + (2 * I + D if self.expert_bias else 0)

    @property
    def rotary_dim(self) -> int:
        """Dims per head that RoPE rotates (the first ones of a query/key head)."""
        if self.mla is not None:
            return self.mla.qk_rope_head_dim
        return self.rope_dim or self.head_dim

    @property
    def kv_cache_dims(self) -> tuple[int, int, int]:
        """(heads, key dim, value dim) of one cached position per layer; value dim 0 = keys only. MLA caches
        the compressed latent and the shared rotary key, one "head" of kv_lora_rank + qk_rope_head_dim."""
        if self.mla is not None:
            return 1, self.mla.kv_lora_rank + self.mla.qk_rope_head_dim, 0
        return self.num_kv_heads, self.head_dim, self.head_dim
