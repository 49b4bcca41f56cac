"""One explicit name map per architecture: which checkpoint key holds which weight,
and the shape it must have. Keys are the ones Hugging Face publishes, so checkpoints are
read exactly as released: per-expert 2-D tensors (Mixtral, Qwen, OLMoE, GLM-4, DeepSeek, MiniMax-M2),
or one fused 3-D tensor per layer (GPT-OSS: `experts.gate_up_proj` [E, D, 2I] with gate and
up interleaved column by column, `experts.down_proj` [E, I, D], and their biases; Llama-4: the same shapes,
gate the first I columns and up the last I, no biases; Qwen3-Next / Qwen3.5 when stored fused, as Qwen3.5 is
published: transformers' `gate_up_proj` [E, 2I, D], gate the first I rows, and `down_proj` [E, D, I]), from which
`ExpertPart` says how one expert's part is cut. Checkpoints that ship quantized experts (config
`quantization_config`) name their stored tensors: GPT-OSS MXFP4 `experts.gate_up_proj_blocks` [E, 2I, D/32, 16]
and `_scales` [E, 2I, D/32] (and the same for `down_proj`, [E, D, I/32, ...]), FP8 `experts.{e}.gate_proj.weight`
(float8_e4m3fn) with `weight_scale_inv` [⌈I/128⌉, ⌈D/128⌉]; an `ExpertPart` then also names its scales."""
from __future__ import annotations

import re
from dataclasses import dataclass

from specmoe.config import ModelConfig
from specmoe.families import family_of


def _names(cfg: ModelConfig):
    """The family's weight names (`Family.names`, declared in its module under specmoe/families/)."""
    return family_of(cfg.model_type).names


def _fused(cfg: ModelConfig) -> bool:
    """The family stores its experts as one [E, ...] tensor per layer and projection (`Family.fused_experts`)."""
    return family_of(cfg.model_type).fused_experts is not None


# Keys some exporters add that carry no weights we need.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_LAYER = re.compile(r"layers\.(\d+)\.")


@dataclass(frozen=True)
class ExpertPart:
    """One part of one expert: checkpoint `key` (a tensor of `tensor_shape`), cut as row `expert` of a fused
    tensor (None: the tensor is this expert's alone), transposed if `transpose` (to the [out, in] the model
    multiplies by), then its rows `start`:`stop`:`step` (a fused gate_up's gate or up: GPT-OSS's interleaved,
    step 2; Llama-4's and transformers' [E, 2I, D] layout's halves, stop; from 0, step 1, no stop: all).

    A quantized part (`scale` set: the key of its scales, a tensor of `scale_shape`, the same row `expert`) is
    first dequantised (weights/quantized.py) into the tensor transformers' dequantised model holds (GPT-OSS:
    [D, 2I] and [I, D], as the floating-point checkpoint stores them), then cut the same way."""
    key: str
    tensor_shape: tuple[int, ...]
    expert: int | None = None
    start: int = 0
    step: int = 1
    transpose: bool = False
    scale: str | None = None
    scale_shape: tuple[int, ...] = ()
    stop: int | None = None


def expert_parts(cfg: ModelConfig, layer: int, expert: int) -> dict[str, ExpertPart]:
    """The parts of one expert in the order they are packed: gate [I, D], up [I, D], down [D, I], then with
    expert biases gate_bias [I], up_bias [I], down_bias [D]."""
    n = _names(cfg)
    D, I, E = cfg.hidden_size, cfg.expert_intermediate_size, cfg.num_experts
    q = cfg.quantization
    if cfg.fused_experts:  # transformers' layout: gate_up_proj [E, 2I, D] (gate rows, then up), down_proj [E, D, I]
        base = f"{cfg.weight_prefix}layers.{layer}.{n.moe_prefix}.experts"
        gu = f"{base}.gate_up_proj"
        return {"gate": ExpertPart(gu, (E, 2 * I, D), expert, 0, stop=I),
                "up": ExpertPart(gu, (E, 2 * I, D), expert, I, stop=2 * I),
                "down": ExpertPart(f"{base}.down_proj", (E, D, I), expert)}
    if family_of(cfg.model_type).fused_experts == "halves":  # [E, D, 2I]: gate columns [0, I), up [I, 2I); down [E, I, D]
        base = f"{cfg.weight_prefix}layers.{layer}.{n.moe_prefix}.experts"
        gu = f"{base}.gate_up_proj"
        return {"gate": ExpertPart(gu, (E, D, 2 * I), expert, 0, transpose=True, stop=I),
                "up": ExpertPart(gu, (E, D, 2 * I), expert, I, transpose=True, stop=2 * I),
                "down": ExpertPart(f"{base}.down_proj", (E, I, D), expert, transpose=True)}
    if cfg.seq2seq is not None:  # NLLB-MoE: fc1 [I, D], fc2 [D, I], fc1 bias [I], fc2 bias [D]
        base = f"{_stack_prefix(cfg, layer)}.{n.moe_prefix}.experts.expert_{expert}"
        return {"gate": ExpertPart(f"{base}.fc1.weight", (I, D)), "down": ExpertPart(f"{base}.fc2.weight", (D, I)),
                "gate_bias": ExpertPart(f"{base}.fc1.bias", (I,)), "down_bias": ExpertPart(f"{base}.fc2.bias", (D,))}
    if _fused(cfg):
        base = f"{cfg.weight_prefix}layers.{layer}.{n.moe_prefix}.experts"
        gub = f"{base}.gate_up_proj_bias"
        if q is not None and q.method == "mxfp4":  # [E, out, in/32, 16] blocks, [E, out, in/32] scales
            gu = dict(key=f"{base}.gate_up_proj_blocks", tensor_shape=(E, 2 * I, D // 32, 16), expert=expert,
                      step=2, transpose=True, scale=f"{base}.gate_up_proj_scales", scale_shape=(E, 2 * I, D // 32))
            down = ExpertPart(f"{base}.down_proj_blocks", (E, D, I // 32, 16), expert, transpose=True,
                              scale=f"{base}.down_proj_scales", scale_shape=(E, D, I // 32))
            gate, up = ExpertPart(**gu, start=0), ExpertPart(**gu, start=1)
        else:
            gu = f"{base}.gate_up_proj"
            gate, up = (ExpertPart(gu, (E, D, 2 * I), expert, start, 2, True) for start in (0, 1))
            down = ExpertPart(f"{base}.down_proj", (E, I, D), expert, transpose=True)
        return {"gate": gate, "up": up, "down": down,
                "gate_bias": ExpertPart(gub, (E, 2 * I), expert, 0, 2),
                "up_bias": ExpertPart(gub, (E, 2 * I), expert, 1, 2),
                "down_bias": ExpertPart(f"{base}.down_proj_bias", (E, D), expert)}
    base = f"{cfg.weight_prefix}layers.{layer}.{n.moe_prefix}.experts.{expert}"
    g, u, d = n.expert_proj

    def part(name: str, rows: int, cols: int) -> ExpertPart:
        key = f"{base}.{name}.weight"
        if q is None:
            return ExpertPart(key, (rows, cols))
        br, bc = q.block  # fp8: one scale per block of rows x columns
        return ExpertPart(key, (rows, cols), scale=key + "_scale_inv", scale_shape=(-(-rows // br), -(-cols // bc)))
    return {"gate": part(g, I, D), "up": part(u, I, D), "down": part(d, D, I)}


def stored_tensors(parts: dict[str, ExpertPart]) -> list[tuple[str, int | None, tuple[int, ...], bool]]:
    """The checkpoint tensors one expert is read from, in first-use order: (key, row of a fused tensor or None,
    shape of the expert's row, is a scale tensor). A tensor several parts cut (GPT-OSS's gate/up) appears once."""
    out, seen = [], set()
    for p in parts.values():
        row = p.tensor_shape[1:] if p.expert is not None else p.tensor_shape
        for key, shape, is_scale in ((p.key, row, False),
                                     (p.scale, (p.scale_shape[1:] if p.expert is not None else p.scale_shape), True)):
            if key is not None and key not in seen:
                seen.add(key)
                out.append((key, p.expert, tuple(shape), is_scale))
    return out


def expert_tensors_per_layer(cfg: ModelConfig) -> int:
    """Distinct checkpoint tensors holding one MoE layer's experts."""
    n = len(stored_tensors(expert_parts(cfg, cfg.moe_layers[0], 0)))
    return n if _fused(cfg) or cfg.fused_experts else n * cfg.num_experts


def stores_fused_experts(cfg: ModelConfig, keys) -> bool:
    """Whether a checkpoint of a family that may store its experts either way (`Family.either_layout`) holds them
    fused (its key names say)."""
    n = _names(cfg)
    return (family_of(cfg.model_type).either_layout and bool(cfg.moe_layers)
            and f"{cfg.weight_prefix}layers.{cfg.moe_layers[0]}.{n.moe_prefix}.experts.gate_up_proj" in keys)


def is_ignored(cfg: ModelConfig, key: str) -> bool:
    """Keys that carry nothing the model uses: rotary caches, the multi-token-prediction layers
    (GLM-4, DeepSeek-V3) stored after the last decoder layer, and the parts a family or a multimodal release
    skips (`skipped_prefixes`: a vision tower and projector, Qwen3-Next's MTP module)."""
    if key.endswith(IGNORED_SUFFIXES) or key.startswith(cfg.skipped_prefixes):
        return True
    if cfg.seq2seq is not None:  # tied: copies of the shared embedding some exporters write; untied: the unused
        # shared one; the position table
        unused = ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight") \
            if cfg.tie_word_embeddings else ("model.shared.weight",)
        return key in unused or ".embed_positions." in key
    m = _LAYER.match(key[len(cfg.weight_prefix):]) if key.startswith(cfg.weight_prefix) else None
    return bool(cfg.extra_layers and m and cfg.num_layers <= int(m.group(1)) < cfg.num_layers + cfg.extra_layers)


def _stack_prefix(cfg: ModelConfig, layer: int) -> str:
    """An encoder–decoder model's checkpoint prefix of global layer `layer` (encoder layers first)."""
    Le = cfg.seq2seq.encoder_layers
    return f"model.encoder.layers.{layer}" if layer < Le else f"model.decoder.layers.{layer - Le}"


def fp32_params(cfg: ModelConfig) -> set[str]:
    """Module parameters kept in fp32 whatever the compute dtype (transformers keeps the sigmoid routers'
    weight and e_score_correction_bias in fp32: the correction bias decides which experts are picked; NLLB-MoE's
    routers run in router_dtype, float32)."""
    if cfg.seq2seq is not None:
        return {f"layers.{i}.mlp.router.{p}" for i in cfg.moe_layers
                for p in (("weight", "bias") if cfg.router_bias else ("weight",))}
    if not cfg.score_correction_bias:
        return set()
    return {f"layers.{i}.mlp.{p}" for i in cfg.moe_layers for p in ("router.weight", "correction_bias")}


def _linear_attention_keys(cfg: ModelConfig, a: str, m: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Gated DeltaNet (models/deltanet.py): Qwen3.5's in_proj_qkv / z / b / a or Qwen3-Next's grouped
    in_proj_qkvz / in_proj_ba, the depthwise conv, the decay parameters, the gated norm and out_proj."""
    la, D = cfg.linear_attention, cfg.hidden_size
    Hv, Dv = la.num_v_heads, la.v_head_dim
    if la.split_projections:
        projs = {"in_proj_qkv": la.conv_dim, "in_proj_z": Hv * Dv, "in_proj_b": Hv, "in_proj_a": Hv}
    else:
        projs = {"in_proj_qkvz": la.conv_dim + Hv * Dv, "in_proj_ba": 2 * Hv}
    out = {m + f"{p}.weight": (a + f"{p}.weight", (n, D)) for p, n in projs.items()}
    out[m + "conv1d.weight"] = (a + "conv1d.weight", (la.conv_dim, 1, la.conv_kernel))
    out[m + "A_log"] = (a + "A_log", (Hv,))
    out[m + "dt_bias"] = (a + "dt_bias", (Hv,))
    out[m + "norm.weight"] = (a + "norm.weight", (Dv,))
    out[m + "out_proj.weight"] = (a + "out_proj.weight", (D, Hv * Dv))
    return out


def _attention_keys(cfg: ModelConfig, a: str, m: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    D, Hq, Hkv, Dh = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    out = {}
    if cfg.mla is not None:  # DeepSeek multi-head latent attention
        ml = cfg.mla
        qk = ml.qk_nope_head_dim + ml.qk_rope_head_dim
        if ml.q_lora_rank is None:
            out[m + "q_proj.weight"] = (a + "q_proj.weight", (Hq * qk, D))
        else:
            out[m + "q_a_proj.weight"] = (a + "q_a_proj.weight", (ml.q_lora_rank, D))
            out[m + "q_a_norm.weight"] = (a + "q_a_layernorm.weight", (ml.q_lora_rank,))
            out[m + "q_b_proj.weight"] = (a + "q_b_proj.weight", (Hq * qk, ml.q_lora_rank))
            if cfg.qkv_bias:
                out[m + "q_a_proj.bias"] = (a + "q_a_proj.bias", (ml.q_lora_rank,))
        out[m + "kv_a_proj.weight"] = (a + "kv_a_proj_with_mqa.weight", (ml.kv_lora_rank + ml.qk_rope_head_dim, D))
        if cfg.qkv_bias:
            out[m + "kv_a_proj.bias"] = (a + "kv_a_proj_with_mqa.bias", (ml.kv_lora_rank + ml.qk_rope_head_dim,))
        out[m + "kv_a_norm.weight"] = (a + "kv_a_layernorm.weight", (ml.kv_lora_rank,))
        out[m + "kv_b_proj.weight"] = (a + "kv_b_proj.weight",
                                       (Hq * (ml.qk_nope_head_dim + ml.v_head_dim), ml.kv_lora_rank))
        out[m + "o_proj.weight"] = (a + "o_proj.weight", (D, Hq * ml.v_head_dim))
        if cfg.o_proj_bias:
            out[m + "o_proj.bias"] = (a + "o_proj.bias", (D,))
        return out
    Q = Hq * Dh * (2 if cfg.attn_output_gate else 1)  # with the output gate: [query; gate] per head
    out[m + "q_proj.weight"] = (a + "q_proj.weight", (Q, D))
    out[m + "k_proj.weight"] = (a + "k_proj.weight", (Hkv * Dh, D))
    out[m + "v_proj.weight"] = (a + "v_proj.weight", (Hkv * Dh, D))
    out[m + "o_proj.weight"] = (a + "o_proj.weight", (D, Hq * Dh))
    if cfg.qkv_bias:
        out[m + "q_proj.bias"] = (a + "q_proj.bias", (Q,))
        out[m + "k_proj.bias"] = (a + "k_proj.bias", (Hkv * Dh,))
        out[m + "v_proj.bias"] = (a + "v_proj.bias", (Hkv * Dh,))
    if cfg.o_proj_bias:
        out[m + "o_proj.bias"] = (a + "o_proj.bias", (D,))
    if cfg.attention_sinks:
        out[m + "sinks"] = (a + "sinks", (Hq,))
    if cfg.qk_norm == "head":
        out[m + "q_norm.weight"] = (a + "q_norm.weight", (Dh,))
        out[m + "k_norm.weight"] = (a + "k_norm.weight", (Dh,))
    elif cfg.qk_norm == "full":
        out[m + "q_norm.weight"] = (a + "q_norm.weight", (Hq * Dh,))
        out[m + "k_norm.weight"] = (a + "k_norm.weight", (Hkv * Dh,))
    return out


def non_expert_keys(cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{module parameter name: (checkpoint key, shape)} for every weight kept resident."""
    D, V, pre = cfg.hidden_size, cfg.vocab_size, cfg.weight_prefix
    n = _names(cfg)
    if cfg.seq2seq is not None:
        return _seq2seq_keys(cfg)
    out = {"embed.weight": (pre + "embed_tokens.weight", (V, D)), "norm.weight": (pre + "norm.weight", (D,))}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.head_prefix + "lm_head.weight", (V, D))
    for i in range(cfg.num_layers):
        p, m = f"{pre}layers.{i}.", f"layers.{i}."
        out[m + "input_norm.weight"] = (p + "input_layernorm.weight", (D,))
        out[m + "post_attn_norm.weight"] = (p + "post_attention_layernorm.weight", (D,))
        if i in cfg.linear_layers:
            out.update(_linear_attention_keys(cfg, p + "linear_attn.", m + "attn."))
        else:
            out.update(_attention_keys(cfg, p + "self_attn.", m + "attn."))
        if cfg.is_moe_layer(i):
            mp = p + n.moe_prefix + "."
            out[m + "mlp.router.weight"] = (mp + n.router + ".weight", (cfg.num_experts, D))
            if cfg.router_bias:
                out[m + "mlp.router.bias"] = (mp + n.router + ".bias", (cfg.num_experts,))
            if cfg.score_correction_bias:
                out[m + "mlp.correction_bias"] = (mp + (n.correction_bias or n.router + ".e_score_correction_bias"),
                                                  (cfg.num_experts,))
            if cfg.shared_expert_intermediate_size:
                S = cfg.shared_expert_intermediate_size
                sp = mp + (n.shared or ("shared_expert" if cfg.shared_expert_gate else "shared_experts")) + "."
                out[m + "mlp.shared.gate_proj.weight"] = (sp + "gate_proj.weight", (S, D))
                out[m + "mlp.shared.up_proj.weight"] = (sp + "up_proj.weight", (S, D))
                out[m + "mlp.shared.down_proj.weight"] = (sp + "down_proj.weight", (D, S))
                if cfg.shared_expert_gate:
                    out[m + "mlp.shared_gate.weight"] = (mp + "shared_expert_gate.weight", (1, D))
        else:
            I = cfg.dense_intermediate_size
            dp = p + n.dense_prefix + "."
            out[m + "mlp.gate_proj.weight"] = (dp + "gate_proj.weight", (I, D))
            out[m + "mlp.up_proj.weight"] = (dp + "up_proj.weight", (I, D))
            out[m + "mlp.down_proj.weight"] = (dp + "down_proj.weight", (D, I))
    return out


def _linear(out: dict, m: str, key: str, rows: int, cols: int) -> None:
    out[m + ".weight"] = (key + ".weight", (rows, cols))
    out[m + ".bias"] = (key + ".bias", (rows,))


def _seq2seq_keys(cfg: ModelConfig) -> dict[str, tuple[str, tuple[int, ...]]]:
    """NLLB-MoE's non-expert weights (module names of `models.seq2seq.Seq2SeqModel`): the shared embedding, per
    layer (global index, encoder first) the biased attention(s), LayerNorms and the dense FFN or the router, the
    two final LayerNorms."""
    D, V, s2s = cfg.hidden_size, cfg.vocab_size, cfg.seq2seq
    if cfg.tie_word_embeddings:  # transformers ties both stacks' embeddings and the LM head to model.shared
        out = {"embed.weight": ("model.shared.weight", (V, D))}
    else:  # untied, each stack reads its own embedding (model.shared is then unused)
        out = {"embed.weight": ("model.decoder.embed_tokens.weight", (V, D)),
               "encoder_embed.weight": ("model.encoder.embed_tokens.weight", (V, D)),
               "lm_head.weight": ("lm_head.weight", (V, D))}
    for stack in ("encoder", "decoder"):
        out[f"{stack}_norm.weight"] = (f"model.{stack}.layer_norm.weight", (D,))
        out[f"{stack}_norm.bias"] = (f"model.{stack}.layer_norm.bias", (D,))
    for i in range(s2s.encoder_layers + cfg.num_layers):
        p, m = _stack_prefix(cfg, i) + ".", f"layers.{i}."
        enc = i < s2s.encoder_layers
        norms = ("self_attn_layer_norm", "ff_layer_norm") + (() if enc else ("cross_attention_layer_norm",))
        for norm in norms:
            out[m + norm + ".weight"] = (p + norm + ".weight", (D,))
            out[m + norm + ".bias"] = (p + norm + ".bias", (D,))
        for attn in ("self_attn",) + (() if enc else ("cross_attention",)):
            for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
                _linear(out, m + f"{attn}.{proj}", p + f"{attn}.{proj}", D, D)
        if cfg.is_moe_layer(i):
            out[m + "mlp.router.weight"] = (p + "ffn.router.classifier.weight", (cfg.num_experts, D))
            if cfg.router_bias:
                out[m + "mlp.router.bias"] = (p + "ffn.router.classifier.bias", (cfg.num_experts,))
        else:
            inter = s2s.encoder_ffn if enc else cfg.dense_intermediate_size
            _linear(out, m + "mlp.fc1", p + "ffn.fc1", inter, D)
            _linear(out, m + "mlp.fc2", p + "ffn.fc2", D, inter)
    return out
