"""Model configuration read from a Hugging Face config.json, checked once at the boundary.

One dataclass for every supported family; per-family differences are plain fields
(`qk_norm`, `shared_expert_intermediate_size`, `mla`, `yarn`, `attention_sinks`, ...) filled by
`ModelConfig.from_hf` (GLM-4 MoE, DeepSeek-V2/V3 and GPT-OSS through `specmoe/families.py`).
Class defaults of transformers are never trusted: every key is read from the file
with the default the family's published checkpoints imply. Every value is checked
for its type and range here (`Fields`), so nothing downstream meets an unchecked
value; a bad one is a CheckpointError naming the file, the field and what was expected.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from specmoe.errors import CheckpointError, UnsupportedModelError

SUPPORTED_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "glm4_moe", "deepseek_v2", "deepseek_v3", "gpt_oss")
# model_types that are another family's architecture under their own name (Kimi-K2 ships DeepSeek-V3's)
MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}
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


QUANT_METHODS = ("mxfp4", "fp8")


def read_quantization(raw: dict, f: "Fields", mt: str, *, hidden: int) -> Quantization | None:
    """`quantization_config` of config.json (None: a floating-point checkpoint)."""
    q = raw.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        f.fail("quantization_config", "an object or null", q)
    qf = Fields(q, f"{f.source} quantization_config")
    method = q.get("quant_method")
    if method not in QUANT_METHODS:
        raise UnsupportedModelError(
            f"{f.source}: quantization_config.quant_method {method!r} is not supported; specmoe reads floating-point "
            "checkpoints, MXFP4 experts as GPT-OSS ships them (\"mxfp4\") and block-scaled FP8 as DeepSeek-V3 ships "
            "it (\"fp8\")")
    if method == "mxfp4":
        if mt != "gpt_oss":
            raise UnsupportedModelError(f"{f.source}: MXFP4 (quant_method \"mxfp4\") is read for GPT-OSS experts only")
        inter = f.int("intermediate_size")
        for key, n in (("hidden_size", hidden), ("intermediate_size", inter)):
            if n % 32:
                f.fail(key, "a multiple of 32 (MXFP4 stores blocks of 32 values along each projection's input)", n)
        return Quantization("mxfp4")
    if mt == "gpt_oss":
        raise UnsupportedModelError(f"{f.source}: GPT-OSS checkpoints are read in floating point or MXFP4, not FP8")
    if qf.str("fmt", "e4m3") != "e4m3":
        raise UnsupportedModelError(f"{qf.source}: fmt {q['fmt']!r} is not supported (FP8 e4m3 only)")
    if qf.str("activation_scheme", "dynamic") != "dynamic":
        raise UnsupportedModelError(f"{qf.source}: activation_scheme {q['activation_scheme']!r} is not supported "
                                    "(\"dynamic\" only: specmoe computes on the dequantised weights)")
    if q.get("scale_fmt") not in (None, "float", "ue8m0"):  # ue8m0: float scales that are powers of two
        qf.fail("scale_fmt", '"float" or "ue8m0"', q["scale_fmt"])
    block = q.get("weight_block_size", [128, 128])
    if (not isinstance(block, list) or len(block) != 2
            or any(type(b) is not int or b < 1 for b in block)):
        qf.fail("weight_block_size", "a list of two integers >= 1 (rows, columns of one scale block)", block)
    return Quantization("fp8", (block[0], block[1]))


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
    shared_expert_intermediate_size: int = 0  # shared expert(s) next to the routed ones (0 = none)
    shared_expert_gate: bool = True  # Qwen2-MoE: sigmoid gate on the shared expert; GLM-4 / DeepSeek: none
    moe_layers: tuple[int, ...] = field(default_factory=tuple)  # which layers are sparse
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "float32"  # dtype the checkpoint was saved in
    # --- RoPE
    rope_dim: int = 0  # dims of a head that rotate (0 = head_dim); GLM-4: partial_rotary_factor · head_dim
    rope_interleave: bool = False  # DeepSeek: rotary pairs stored interleaved (x0, x1), (x2, x3), ...
    yarn: Yarn | None = None  # YaRN RoPE scaling (DeepSeek-V3, GPT-OSS); None = plain RoPE
    # --- attention
    mla: MLA | None = None  # DeepSeek multi-head latent attention (None = standard GQA attention)
    o_proj_bias: bool = False  # GPT-OSS
    attention_sinks: bool = False  # GPT-OSS: a learned per-head logit that joins every softmax
    sliding_layers: tuple[int, ...] | None = None  # layers using sliding_window (None: all of them)
    # --- routing (the rule itself is per family: models/routers.py)
    router_bias: bool = False  # GPT-OSS: the router linear has a bias
    score_correction_bias: bool = False  # GLM-4 / DeepSeek-V3: e_score_correction_bias picks, weights don't use it
    n_group: int = 1  # group-limited top-k: experts in n_group groups, only topk_group groups eligible
    topk_group: int = 1
    routed_scaling_factor: float = 1.0  # routed experts' weights are multiplied by this
    # --- experts
    expert_bias: bool = False  # GPT-OSS: gate/up and down biases packed after the weights
    swiglu_limit: float | None = None  # GPT-OSS clamped SwiGLU: (clamp(up) + 1) · g·σ(α·g), g = min(gate, limit)
    swiglu_alpha: float = 1.702
    extra_layers: int = 0  # multi-token-prediction layers stored after the last layer (not used, not loaded)
    # --- storage
    quantization: Quantization | None = None  # weights shipped quantized (read as stored; None: floating point)

    def __post_init__(self):
        if not self.moe_layers:
            self.moe_layers = tuple(range(self.num_layers))
        if self.sliding_layers is None:
            self.sliding_layers = tuple(range(self.num_layers))
        # from_hf checks these with the file's field names; direct construction gets the same guarantees
        if self.num_kv_heads < 1 or self.num_heads % self.num_kv_heads:
            raise CheckpointError("config.json: num_attention_heads must be a multiple of num_key_value_heads; "
                                  f"got {self.num_heads} and {self.num_kv_heads}")
        if not 1 <= self.top_k <= self.num_experts:
            raise CheckpointError(f"config.json: num_experts_per_tok must be in [1, {self.num_experts}] "
                                  f"(the number of experts); got {self.top_k}")

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    def window(self, layer: int) -> int | None:
        """The sliding window of `layer`'s attention (None: full causal attention)."""
        return self.sliding_window if self.sliding_window and layer in self.sliding_layers else None

    @property
    def expert_numel(self) -> int:
        """Elements of one expert packed as [gate; up; down] (3 · I · D), then, with expert biases,
        [gate bias (I); up bias (I); down bias (D)]."""
        I, D = self.expert_intermediate_size, self.hidden_size
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

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        cfg_path = path / "config.json"
        if not path.is_dir():
            raise CheckpointError(f"model directory not found: {path}")
        if not cfg_path.is_file():
            raise CheckpointError(f"missing config.json in {path}")
        raw = read_json_object(cfg_path)
        gen = path / "generation_config.json"
        gen_raw = read_json_object(gen) if gen.is_file() else None
        return cls.from_hf(raw, generation_config=gen_raw)

    @classmethod
    def from_hf(cls, raw: dict, generation_config: dict | None = None) -> "ModelConfig":
        if not isinstance(raw, dict):
            raise CheckpointError(f"config.json must hold a JSON object, got {type_name(raw)}")
        mt = raw.get("model_type")
        mt = MODEL_TYPE_ALIASES.get(mt, mt) if isinstance(mt, str) else mt
        if mt not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"unsupported model_type {mt!r}; supported: {', '.join(SUPPORTED_MODEL_TYPES)} "
                f"(and {', '.join(MODEL_TYPE_ALIASES)})")
        f = Fields(raw, f"config.json ({mt})")

        from specmoe import families  # the newer families' readers (imports this module)
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or families.DEFAULT_ROPE.get(mt) or {}
        if not isinstance(rope, dict):
            f.fail("rope_parameters" if raw.get("rope_parameters") else "rope_scaling", "an object or null", rope)
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None) and not (rope_type == "yarn" and mt in families.YARN_FAMILIES):
            raise UnsupportedModelError(f"rope type {rope_type!r} is not supported for {mt}")
        rope_theta = f.float("rope_theta", families.DEFAULT_THETA.get(mt, 10000.0),
                             value=rope.get("rope_theta", raw.get("rope_theta")))
        prf = f.float("partial_rotary_factor", 0.5 if mt == "glm4_moe" else 1.0,
                      value=rope.get("partial_rotary_factor", raw.get("partial_rotary_factor")))
        if prf != 1.0 and mt != "glm4_moe":
            raise UnsupportedModelError("partial rotary embeddings are not supported")
        if prf > 1.0:
            f.fail("partial_rotary_factor", "a number in (0, 1]", prf)

        V = f.int("vocab_size")
        H = f.int("hidden_size")
        n_heads = f.int("num_attention_heads")
        n_kv = f.int("num_key_value_heads", default=n_heads, hi=n_heads)
        if n_heads % n_kv:
            f.fail("num_key_value_heads", f"a divisor of num_attention_heads ({n_heads})", n_kv)
        if raw.get("head_dim") is None and H % n_heads:
            f.fail("hidden_size", f"a multiple of num_attention_heads ({n_heads}) when head_dim is absent", H)
        head_dim = f.int("head_dim", default=H // n_heads)
        L = f.int("num_hidden_layers")
        E = f.int("n_routed_experts") if mt in ("glm4_moe", "deepseek_v2", "deepseek_v3") else f.int("num_local_experts", "num_experts")
        top_k = f.int("num_experts_per_tok", hi=E)
        act = f.str("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only silu)")

        kw: dict = {}
        if mt == "mixtral":
            kw.update(expert_intermediate_size=f.int("intermediate_size"), dense_intermediate_size=0,
                      norm_topk_prob=True, sliding_window=f.int("sliding_window", default=None))
        elif mt in ("qwen2_moe", "qwen3_moe"):
            step = f.int("decoder_sparse_step", default=1)
            mlp_only = raw.get("mlp_only_layers") or []
            if not isinstance(mlp_only, list) or any(type(i) is not int or not 0 <= i < L for i in mlp_only):
                f.fail("mlp_only_layers", f"a list of layer indices in [0, {L})", raw.get("mlp_only_layers"))
            moe_layers = tuple(i for i in range(L) if i not in set(mlp_only) and (i + 1) % step == 0)
            if not moe_layers:
                f.fail("decoder_sparse_step / mlp_only_layers", "settings that leave at least one MoE layer",
                       (step, mlp_only))
            dense = len(moe_layers) < L
            kw.update(expert_intermediate_size=f.int("moe_intermediate_size"),
                      dense_intermediate_size=f.int("intermediate_size", default=0, lo=1 if dense else 0),
                      norm_topk_prob=f.bool("norm_topk_prob", False), moe_layers=moe_layers)
            if dense and not kw["dense_intermediate_size"]:
                f.fail("intermediate_size", "an integer >= 1 (the model has dense layers)")
            if f.bool("use_sliding_window", False):
                raise UnsupportedModelError(f"{mt} with use_sliding_window=true is not supported yet")
            if mt == "qwen2_moe":
                kw.update(qkv_bias=f.bool("qkv_bias", True), shared_expert_intermediate_size=f.int(
                    "shared_expert_intermediate_size", default=0, lo=0))
            else:
                bias = f.bool("attention_bias", False)  # transformers: q/k/v and o projections all biased
                kw.update(qk_norm="head", qkv_bias=bias, o_proj_bias=bias)
        elif mt == "olmoe":
            bias = f.bool("attention_bias", False)  # transformers: q/k/v and o projections all biased
            kw.update(expert_intermediate_size=f.int("intermediate_size"), dense_intermediate_size=0,
                      norm_topk_prob=f.bool("norm_topk_prob", False), qk_norm="full",
                      qkv_bias=bias, o_proj_bias=bias, clip_qkv=f.float("clip_qkv", None))
            if head_dim != H // n_heads:
                raise UnsupportedModelError("OLMoE with head_dim != hidden_size / num_attention_heads")
        else:  # glm4_moe, deepseek_v2, deepseek_v3, gpt_oss
            kw.update(families.read(mt, f, num_layers=L, num_experts=E, top_k=top_k, head_dim=head_dim, prf=prf,
                                    rope=rope if rope_type == "yarn" else None))

        eos_ids = f.token_ids("eos_token_id", V)
        if generation_config is not None:
            if not isinstance(generation_config, dict):
                raise CheckpointError(f"generation_config.json must hold a JSON object, "
                                      f"got {type_name(generation_config)}")
            if generation_config.get("eos_token_id") is not None:
                eos_ids = Fields(generation_config, "generation_config.json").token_ids("eos_token_id", V)
        bos = f.token_ids("bos_token_id", V)
        if isinstance(raw.get("bos_token_id"), list):
            f.fail("bos_token_id", "a token id or null", raw["bos_token_id"])
        dk, dtype = f.first("dtype", "torch_dtype")
        dtype = "float32" if dtype is _MISSING else dtype
        if dtype not in FLOAT_DTYPES:
            f.fail(dk, f"a floating dtype name ({', '.join(FLOAT_DTYPES)})", dtype)
        kw["quantization"] = read_quantization(raw, f, mt, hidden=H)
        return cls(model_type=mt, vocab_size=V, hidden_size=H, num_layers=L, num_heads=n_heads,
                   num_kv_heads=n_kv, head_dim=kw.pop("head_dim", head_dim), num_experts=E, top_k=top_k,
                   rms_norm_eps=f.float("rms_norm_eps", 1e-6), rope_theta=rope_theta,
                   max_position_embeddings=f.int("max_position_embeddings", default=4096, lo=2),
                   tie_word_embeddings=f.bool("tie_word_embeddings", False), hidden_act=act,
                   bos_token_id=bos[0] if bos else None, eos_token_ids=eos_ids, dtype=dtype, **kw)
