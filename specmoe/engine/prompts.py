"""Prompt normalisation for `LLM.generate` / `LLM.logits`: what a caller may pass, checked once.

Accepted: a string, a list of token ids (one prompt), or a list/tuple whose items are strings or
token-id lists (a batch; the two kinds may be mixed). Token ids are integers (Python ints or
numpy/other integral scalars), never booleans or floats. Everything else (bytes, tensors,
generators, dicts, a list mixing ids and prompts, lone surrogates) is an InputError naming the
prompt and what was expected; nothing is guessed.
"""
from __future__ import annotations

import numbers

from specmoe.decoding.runtime.sampling import SamplingParams
from specmoe.errors import InputError

EXPECTED = "a string, a list of token ids, or a list of those"


def _kind(x) -> str:
    return type(x).__module__.split(".")[0] + "." + type(x).__name__ if type(x).__module__ != "builtins" \
        else type(x).__name__


def _is_id(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _hint(x) -> str:
    if isinstance(x, (bytes, bytearray, memoryview)):
        return "; decode bytes to str first (e.g. data.decode('utf-8'))"
    if hasattr(x, "tolist") and hasattr(x, "shape"):
        return "; pass token ids as a Python list (tensor.tolist())"
    if isinstance(x, dict):
        return "; pass the prompt text itself, not a dict"
    if hasattr(x, "__next__") or hasattr(x, "__iter__"):
        return "; pass a list (e.g. list(prompts))"
    return ""


def _ids(p, i: int) -> list[int]:
    """One token-id prompt (a list or tuple) as a list of ints."""
    for j, t in enumerate(p):
        if not _is_id(t):
            what = "a boolean" if isinstance(t, bool) else f"{_kind(t)} {t!r}"[:80]
            raise InputError(f"prompt {i}: token ids must be integers; item {j} is {what}")
    return [int(t) for t in p]


def split_prompts(prompts) -> list[str | list[int]]:
    """The batch as a list whose items are a str or a list of ints."""
    if isinstance(prompts, str):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise InputError(f"prompts must be {EXPECTED}; got {_kind(prompts)}{_hint(prompts)}")
    if not prompts:
        raise InputError("empty prompt list: pass at least one prompt")
    if isinstance(prompts[0], numbers.Number):  # one token-id prompt; _ids names any item that is not an id
        return [_ids(prompts, 0)]
    out: list[str | list[int]] = []
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            out.append(p)
        elif isinstance(p, (list, tuple)):
            out.append(_ids(p, i))
        else:
            raise InputError(f"prompt {i} is {_kind(p)}; each prompt must be a string or a list of token ids"
                             f"{_hint(p)}")
    return out


def normalize_prompts(prompts, *, tokenizer, vocab_size: int, max_model_len: int, model_path,
                      scoring: bool = False) -> tuple[list[str | None], list[list[int]]]:
    """(texts or None per prompt, token ids per prompt), every prompt checked against the model. A prompt to
    generate from must leave room for one generated token (< max_model_len tokens); one to score (`scoring`)
    generates nothing, so it may fill the context (<= max_model_len)."""
    texts, ids = [], []
    for i, p in enumerate(split_prompts(prompts)):
        if isinstance(p, str):
            if tokenizer is None:
                raise InputError(f"{model_path} has no tokenizer.json; pass prompts as token-id lists")
            try:
                p.encode("utf-8")
            except UnicodeEncodeError as e:
                raise InputError(f"prompt {i} is not valid Unicode text (a lone surrogate at character "
                                 f"{e.start})") from None
            texts.append(p)
            ids.append(tokenizer.encode(p))
        else:
            texts.append(None)
            ids.append(p)
        if not ids[-1]:
            raise InputError(f"prompt {i} is empty")
        bad = [t for t in ids[-1] if not 0 <= t < vocab_size]
        if bad:
            raise InputError(f"prompt {i} has token ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
        if scoring and len(ids[-1]) > max_model_len:
            raise InputError(f"prompt {i} has {len(ids[-1])} tokens; the context length is {max_model_len}")
        if not scoring and len(ids[-1]) >= max_model_len:
            raise InputError(f"prompt {i} has {len(ids[-1])} tokens; the context length is {max_model_len} "
                             "(prompt + at least one generated token must fit)")
    return texts, ids


def normalize_params(params, n: int) -> list[SamplingParams]:
    """One SamplingParams per prompt: None (defaults), one for all, or a list of n."""
    if params is None:
        params = SamplingParams()
    if isinstance(params, SamplingParams):
        return [params] * n
    if not isinstance(params, (list, tuple)) or not all(isinstance(p, SamplingParams) for p in params):
        raise InputError(f"params must be a SamplingParams or a list of them, got {_kind(params)}")
    if len(params) != n:
        raise InputError(f"{len(params)} SamplingParams for {n} prompts")
    return list(params)
