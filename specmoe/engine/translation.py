"""Translation requests for encoder–decoder models (NLLB-MoE): source text + languages → (encoder input, decoder
prompt), with NLLB's conventions (transformers' `NllbTokenizer`, non-legacy):

- the source is `[source language code] tokens </s>` (default source language eng_Latn, as NllbTokenizer's);
- the decoder starts with `decoder_start_token_id` (</s>) and then the target language code, which transformers'
  `generate` forces as the first generated token (`forced_bos_token_id`); here both are the decoder's prompt, so the
  first sampled token is the first word of the translation.

A prompt given as token ids is the encoder's input as it is (its language code and </s> included). Language codes
are tokens of the model's tokenizer (`fra_Latn`, ...) or token ids. A decoder-only model given a target language,
and an encoder–decoder model given none, are `InputError`s.
"""
from __future__ import annotations

from dataclasses import dataclass

from specmoe.config import ModelConfig
from specmoe.engine.prompts import split_prompts
from specmoe.errors import InputError

DEFAULT_SOURCE_LANG = "eng_Latn"  # NllbTokenizer's default src_lang

Lang = str | int


@dataclass
class TranslationRequest:
    text: str | None  # the source text (None: given as token ids)
    source_ids: list[int]  # the encoder's input
    prompt_ids: list[int]  # the decoder's prompt: [decoder start, target language]


def _per_prompt(value, n: int, name: str) -> list:
    if isinstance(value, (list, tuple)):
        if len(value) != n:
            raise InputError(f"{len(value)} {name} values for {n} prompts")
        return list(value)
    return [value] * n


def _lang_id(lang: Lang, tokenizer, cfg: ModelConfig, model_path, name: str) -> int:
    if isinstance(lang, int) and not isinstance(lang, bool):
        if not 0 <= lang < cfg.vocab_size:
            raise InputError(f"{name} token id {lang} is outside the vocabulary [0, {cfg.vocab_size})")
        return lang
    if not isinstance(lang, str) or not lang:
        raise InputError(f"{name} must be a language code such as 'fra_Latn' or a token id; got {lang!r}")
    if tokenizer is None:
        raise InputError(f"{model_path} has no tokenizer.json: give {name} as a token id")
    tid = tokenizer.token_id(lang)
    if tid is None:
        raise InputError(f"unknown {name} {lang!r}: not a token of {model_path}'s tokenizer (NLLB codes look like "
                         "'fra_Latn', 'deu_Latn', 'zho_Hans')")
    return tid


def check_translation_args(cfg: ModelConfig, target_lang, source_lang, model_path) -> None:
    """A decoder-only model takes no languages; an encoder–decoder model needs a target language."""
    if cfg.seq2seq is None:
        if target_lang is not None or source_lang is not None:
            raise InputError(f"target_lang / source_lang are for encoder–decoder (translation) models; {model_path} "
                             f"is a decoder-only {cfg.model_type} model")
        return
    if target_lang is None or (isinstance(target_lang, (list, tuple)) and any(t is None for t in target_lang)):
        raise InputError(f"{model_path} is a translation model ({cfg.model_type}): give target_lang (a language "
                         "code such as 'fra_Latn') for every prompt")


def translation_requests(prompts, target_lang, source_lang, *, tokenizer, cfg: ModelConfig, max_model_len: int,
                         model_path) -> list[TranslationRequest]:
    """One `TranslationRequest` per prompt; target_lang / source_lang: one for all or one per prompt."""
    check_translation_args(cfg, target_lang, source_lang, model_path)
    items = split_prompts(prompts)
    n, s2s = len(items), cfg.seq2seq
    targets = _per_prompt(target_lang, n, "target_lang")
    sources = [DEFAULT_SOURCE_LANG if s is None else s for s in _per_prompt(source_lang, n, "source_lang")]
    eos = cfg.eos_token_ids[0] if cfg.eos_token_ids else (tokenizer.eos_token_id if tokenizer is not None else None)
    out = []
    for i, (p, tgt, src) in enumerate(zip(items, targets, sources)):
        tgt_id = _lang_id(tgt, tokenizer, cfg, model_path, "target_lang")
        if isinstance(p, str):
            if tokenizer is None:
                raise InputError(f"{model_path} has no tokenizer.json; pass prompts as token-id lists")
            if eos is None:
                raise InputError(f"{model_path} names no eos_token_id: cannot end the source")
            text_ids = tokenizer.encode(p, special=False)
            if not text_ids:
                raise InputError(f"prompt {i} is empty")
            ids = [_lang_id(src, tokenizer, cfg, model_path, "source_lang"), *text_ids, eos]
        else:
            ids = list(p)
            if not ids:
                raise InputError(f"prompt {i} is empty")
            bad = [t for t in ids if not 0 <= t < cfg.vocab_size]
            if bad:
                raise InputError(f"prompt {i} has token ids outside the vocabulary [0, {cfg.vocab_size}): {bad[:5]}")
        if len(ids) > cfg.max_position_embeddings:
            raise InputError(f"prompt {i} has {len(ids)} source tokens; the encoder takes at most "
                             f"{cfg.max_position_embeddings}")
        prompt = [s2s.decoder_start_token_id, tgt_id]
        if len(prompt) >= max_model_len:
            raise InputError(f"the context length {max_model_len} leaves no room to generate")
        out.append(TranslationRequest(p if isinstance(p, str) else None, ids, prompt))
    return out
