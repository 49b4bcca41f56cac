"""config.json → `ModelConfig`: what every family reads alike, then the family's own fields (its module under
specmoe/families/, looked up by model_type). Class defaults of transformers are never trusted: every key is
read from the file with the default the family's published checkpoints imply, checked for its type and range
(`Fields`); a bad value is a CheckpointError naming the file, the field and what was expected."""
from __future__ import annotations

from pathlib import Path

from specmoe.config import _MISSING, FLOAT_DTYPES, Fields, ModelConfig, read_json_object, type_name
from specmoe.errors import CheckpointError, UnsupportedModelError
from specmoe.families.parts import read_llama3_rope, read_yarn
from specmoe.families.quantization import read_quantization
from specmoe.families.registry import Family, Shape, family_of


def load_config(path: str | Path) -> ModelConfig:
    """The config of a checkpoint directory: config.json, and generation_config.json's EOS ids if it has one."""
    path = Path(path)
    cfg_path = path / "config.json"
    if not path.is_dir():
        raise CheckpointError(f"model directory not found: {path}")
    if not cfg_path.is_file():
        raise CheckpointError(f"missing config.json in {path}")
    gen = path / "generation_config.json"
    return read_config(read_json_object(cfg_path), read_json_object(gen) if gen.is_file() else None)


def read_config(raw: dict, generation_config: dict | None = None) -> ModelConfig:
    if not isinstance(raw, dict):
        raise CheckpointError(f"config.json must hold a JSON object, got {type_name(raw)}")
    fam = family_of(raw.get("model_type"))
    outer, source = fam, f"config.json ({fam.model_type})"
    if fam.text_family is not None:  # a multimodal release: its language model's fields are nested
        raw, fam = _text_config(raw, fam), family_of(fam.text_family)
        source = f"config.json text_config ({fam.model_type})"
    f = Fields(raw, source)
    rope, rope_theta, prf = _rope(f, fam)
    shape = fam.shape(f, rope, prf) if fam.shape is not None else _shape(f, fam, rope, prf)
    # where the weights are (the release's own layout) and what is not loaded (the text family's and the release's)
    kw = {**fam.read(f, shape), "weight_prefix": outer.weight_prefix, "head_prefix": outer.head_prefix,
          "skipped_prefixes": fam.skipped + (outer.skipped if outer is not fam else ())}
    rope_type = rope.get("rope_type", rope.get("type"))
    if fam.yarn and rope_type == "yarn":
        kw["yarn"] = read_yarn(f, rope)
    if fam.llama3_rope and rope_type == "llama3":
        kw["llama3_rope"] = read_llama3_rope(f, rope)
    kw.update(_special_tokens(f, shape.vocab_size, generation_config), dtype=_dtype(f))
    kw["quantization"] = read_quantization(f, fam, hidden=shape.hidden_size,
                                           expert_intermediate=kw["expert_intermediate_size"])
    return ModelConfig(model_type=fam.model_type, vocab_size=shape.vocab_size, hidden_size=shape.hidden_size,
                       num_layers=shape.num_layers, num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
                       head_dim=kw.pop("head_dim", shape.head_dim), num_experts=shape.num_experts, top_k=shape.top_k,
                       rms_norm_eps=f.float("rms_norm_eps", 1e-6), rope_theta=rope_theta,
                       max_position_embeddings=f.int("max_position_embeddings", default=4096, lo=2),
                       tie_word_embeddings=kw.pop("tie_word_embeddings", None) if "tie_word_embeddings" in kw
                       else f.bool("tie_word_embeddings", False),
                       hidden_act="silu", **kw)


def _text_config(raw: dict, fam: Family) -> dict:
    """The language model's fields of a multimodal config.json (`text_config`), with the wrapper's dtype and
    quantization_config where the nested object has none, and the wrapper's tie_word_embeddings when the LM head
    is the wrapper's own (no `head_prefix`: Qwen3.5's top-level lm_head; see `Family.text_family`)."""
    text = raw.get("text_config")
    outer = Fields(raw, f"config.json ({fam.model_type})")
    if not isinstance(text, dict):
        outer.fail("text_config", "an object (the language model's config)", text if text is not None else _MISSING)
    if text.get("model_type", fam.text_family) != fam.text_family:
        outer.fail("text_config.model_type", repr(fam.text_family), text["model_type"])
    inherited = {k: raw[k] for k in ("dtype", "torch_dtype", "quantization_config")
                 if raw.get(k) is not None and text.get(k) is None}
    own_head = {"tie_word_embeddings": raw["tie_word_embeddings"]} \
        if not fam.head_prefix and raw.get("tie_word_embeddings") is not None else {}
    return {**inherited, **text, **own_head, "model_type": fam.text_family}


def _rope(f: Fields, fam: Family) -> tuple[dict, float, float]:
    """(rope parameters, rope_theta, partial_rotary_factor); rope types other than plain and the YaRN of the
    families that use it, and partial rotation outside the families that use it, are unsupported."""
    raw = f.raw
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or fam.default_rope or {}
    if not isinstance(rope, dict):
        f.fail("rope_parameters" if raw.get("rope_parameters") else "rope_scaling", "an object or null", rope)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", None) and not (rope_type == "yarn" and fam.yarn) \
            and not (rope_type == "llama3" and fam.llama3_rope):
        raise UnsupportedModelError(f"rope type {rope_type!r} is not supported for {fam.model_type}")
    theta = f.float("rope_theta", fam.rope_theta, value=rope.get("rope_theta", raw.get("rope_theta")))
    prf = f.float("partial_rotary_factor", fam.partial_rotary_factor or 1.0,
                  value=rope.get("partial_rotary_factor", raw.get("partial_rotary_factor")))
    if prf != 1.0 and fam.partial_rotary_factor is None:
        raise UnsupportedModelError("partial rotary embeddings are not supported")
    if prf > 1.0:
        f.fail("partial_rotary_factor", "a number in (0, 1]", prf)
    return rope, theta, prf


def _shape(f: Fields, fam: Family, rope: dict, prf: float) -> Shape:
    V = f.int("vocab_size")
    H = f.int("hidden_size")
    n_heads = f.int("num_attention_heads")
    n_kv = f.int("num_key_value_heads", default=n_heads, hi=n_heads)
    if n_heads % n_kv:
        f.fail("num_key_value_heads", f"a divisor of num_attention_heads ({n_heads})", n_kv)
    if f.raw.get("head_dim") is None and H % n_heads:
        f.fail("hidden_size", f"a multiple of num_attention_heads ({n_heads}) when head_dim is absent", H)
    head_dim = f.int("head_dim", default=H // n_heads)
    L = f.int("num_hidden_layers")
    E = f.int(*fam.experts_key)
    top_k = f.int("num_experts_per_tok", hi=E)
    act = f.str("hidden_act", "silu")
    if act != "silu":
        raise UnsupportedModelError(f"hidden_act {act!r} is not supported (only silu)")
    return Shape(vocab_size=V, hidden_size=H, num_heads=n_heads, num_kv_heads=n_kv, head_dim=head_dim, num_layers=L,
                 num_experts=E, top_k=top_k, partial_rotary_factor=prf, rope=rope)


def _special_tokens(f: Fields, vocab: int, generation_config: dict | None) -> dict:
    """EOS ids (generation_config.json's when it names them) and the BOS id."""
    eos = f.token_ids("eos_token_id", vocab)
    if generation_config is not None:
        if not isinstance(generation_config, dict):
            raise CheckpointError(f"generation_config.json must hold a JSON object, "
                                  f"got {type_name(generation_config)}")
        if generation_config.get("eos_token_id") is not None:
            eos = Fields(generation_config, "generation_config.json").token_ids("eos_token_id", vocab)
    bos = f.token_ids("bos_token_id", vocab)
    if isinstance(f.raw.get("bos_token_id"), list):
        f.fail("bos_token_id", "a token id or null", f.raw["bos_token_id"])
    return {"eos_token_ids": eos, "bos_token_id": bos[0] if bos else None}


def _dtype(f: Fields) -> str:
    key, dtype = f.first("dtype", "torch_dtype")
    dtype = "float32" if dtype is _MISSING else dtype
    if dtype not in FLOAT_DTYPES:
        f.fail(key, f"a floating dtype name ({', '.join(FLOAT_DTYPES)})", dtype)
    return dtype
