"""OpenAI request bodies → checked generation requests; errors in OpenAI's error shape.

Every check names the field it refuses (`param` in the error body and in the message), so a
client learns what to fix; nothing reaches the engine unchecked. Supported fields:
prompt / messages, max_tokens (chat also max_completion_tokens), temperature, top_p, top_k and
ignore_eos (extensions, as in vLLM), seed, stop, n, stream, stream_options.include_usage,
logprobs (completions: top-N; chat: bool with top_logprobs), model, user (ignored). Sampling
fields this engine does not implement are refused when set to anything but their no-op value.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

from specmoe.decoding.runtime.sampling import SamplingParams
from specmoe.engine.translation import check_translation_args, translation_requests
from specmoe.errors import InputError
from specmoe.options import SEED_RANGE

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# fields accepted only at their no-op value (name -> values that mean "off")
UNSUPPORTED = {"presence_penalty": (0, 0.0, None), "frequency_penalty": (0, 0.0, None), "logit_bias": (None, {}),
               "echo": (False, None), "suffix": (None, ""), "best_of": (None, 1), "tools": (None, []),
               "functions": (None, []), "response_format": (None, {"type": "text"}), "parallel_tool_calls": (None,)}


class OpenAIError(Exception):
    """An HTTP error answered in OpenAI's body shape: {"error": {message, type, param, code}}."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None, headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str | None, message: str, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


@dataclass
class GenerationRequest:
    """A checked request: `prompts` (text or None, token ids) each generating `n` choices with `params`
    (choice j of a seeded request uses seed + j). `logprobs`: None, or top-N per token."""
    kind: str  # "completion" | "chat"
    model: str
    prompts: list[tuple[str | None, list[int]]]
    params: list[SamplingParams]  # one per prompt (max_tokens may differ: the context left)
    n: int
    stream: bool
    include_usage: bool
    logprobs: int | None
    # encoder–decoder (translation) models: each prompt's encoder input; `prompts` then hold the decoder's
    sources: list[list[int]] | None = None

    def choice_params(self, i: int, j: int) -> SamplingParams:
        p = self.params[i]
        if p.seed is None or j == 0:
            return p
        seed = p.seed + j
        if seed > SEED_RANGE[1]:
            seed -= SEED_RANGE[1] - SEED_RANGE[0] + 1
        return SamplingParams(**{**p.__dict__, "seed": seed, "stop": list(p.stop)})


def parse_json(raw: bytes) -> dict:
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as e:
        raise bad(None, f"malformed JSON body: {e}") from None
    if not isinstance(body, dict):
        raise bad(None, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(body: dict, name: str, default, *, lo: float, lo_open: bool, hi: float | None = None):
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad(name, f"'{name}' must be a finite number, got {v!r}")
    if (v <= lo if lo_open else v < lo) or (hi is not None and v > hi):
        rng = f"{'>' if lo_open else '>='} {lo:g}" + (f" and <= {hi:g}" if hi is not None else "")
        raise bad(name, f"'{name}' must be {rng}, got {v!r}")
    return float(v)


def _int(body: dict, name: str, default, *, lo: int, hi: int | None = None):
    v = body.get(name)
    if v is None:
        return default
    if not _is_int(v):
        raise bad(name, f"'{name}' must be an integer, got {v!r}")
    if v < lo or (hi is not None and v > hi):
        rng = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise bad(name, f"'{name}' must be an integer {rng}, got {v!r}")
    return v


def _bool(body: dict, name: str, default: bool) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(name, f"'{name}' must be true or false, got {v!r}")
    return v


def check_model(body: dict, served: str) -> str:
    m = body.get("model")
    if m is None:
        return served
    if not isinstance(m, str):
        raise bad("model", f"'model' must be a string, got {m!r}")
    if m != served:
        raise OpenAIError(404, f"The model '{m}' does not exist; this server serves '{served}'", param="model",
                          code="model_not_found")
    return m


def _common(body: dict, config) -> dict:
    """The sampling and streaming fields shared by both endpoints."""
    for name, off in UNSUPPORTED.items():
        if name in body and body[name] not in off:
            raise bad(name, f"'{name}' is not supported by this server")
    out = {"temperature": _number(body, "temperature", 1.0, lo=0.0, lo_open=False),
           "top_p": _number(body, "top_p", 1.0, lo=0.0, lo_open=True, hi=1.0),
           "n": _int(body, "n", 1, lo=1, hi=config.max_n),
           "stream": _bool(body, "stream", False),
           "ignore_eos": _bool(body, "ignore_eos", False)}
    k = body.get("top_k")
    out["top_k"] = 0 if k in (None, -1) else _int(body, "top_k", 0, lo=0)
    out["seed"] = _int(body, "seed", None, lo=SEED_RANGE[0], hi=SEED_RANGE[1])
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
        raise bad("stop", f"'stop' must be a non-empty string or a list of them, got {body.get('stop')!r}")
    out["stop"] = stop
    so = body.get("stream_options")
    if so is not None:
        if not isinstance(so, dict) or not isinstance(so.get("include_usage", False), bool):
            raise bad("stream_options", "'stream_options' must be an object like {\"include_usage\": true}")
        if not out["stream"]:
            raise bad("stream_options", "'stream_options' is only allowed when 'stream' is true")
    out["include_usage"] = bool(so and so.get("include_usage"))
    return out


def _max_tokens(body: dict, name: str, prompt_len: int, max_model_len: int, default: int | None) -> int:
    """Explicit max_tokens must fit the context with the prompt; the default is capped to what is left."""
    left = max_model_len - prompt_len
    v = body.get(name)
    if v is None:
        return left if default is None else min(default, left)
    if not _is_int(v) or v < 1:
        raise bad(name, f"'{name}' must be an integer >= 1, got {v!r}")
    if v > left:
        raise bad(name, f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                        f"{prompt_len + v} tokens ({prompt_len} in the prompt, {v} in the completion); reduce "
                        f"'{name}' to at most {left}", code="context_length_exceeded")
    return v


def _check_ids(ids: list[int], param: str, llm) -> None:
    V, M = llm.config.vocab_size, llm.max_model_len
    if not ids:
        raise bad(param, f"'{param}' is empty")
    if len(ids) >= M:  # before the vocabulary scan: a huge list is refused on its length
        raise bad(param, f"'{param}' has {len(ids)} tokens; this model's context length is {M} (the prompt and at "
                         "least one generated token must fit)", code="context_length_exceeded")
    bad_ids = [t for t in ids if not 0 <= t < V]
    if bad_ids:
        raise bad(param, f"'{param}' has token ids outside the vocabulary [0, {V}): {bad_ids[:5]}")


CHARS_PER_TOKEN_MARGIN = 4  # normalizers may shrink text before it is tokenized (NFC composes up to 3 characters)


def max_prompt_chars(llm) -> int | None:
    """The most characters a prompt can have and still fit the context: the context length × the longest
    vocabulary entry × a margin. Longer text is certainly too long and is refused without tokenizing it
    (tokenizing 10 MB of text takes seconds and a gigabyte). None: the model has no tokenizer."""
    if llm.tokenizer is None:
        return None
    return llm.max_model_len * llm.tokenizer.max_token_chars * CHARS_PER_TOKEN_MARGIN


def _encode(llm, text: str, param: str, *, special: bool = True) -> list[int]:
    """Token ids of `text` (called on a worker thread: the tokenizer releases the GIL while it works)."""
    if llm.tokenizer is None:
        raise bad(param, "this model has no tokenizer.json: pass the prompt as token ids")
    limit = max_prompt_chars(llm)
    if len(text) > limit:
        raise bad(param, f"'{param}' has {len(text)} characters; this model's context length is "
                         f"{llm.max_model_len} tokens and no token spans more than "
                         f"{llm.tokenizer.max_token_chars} characters, so at most {limit} characters can fit",
                  code="context_length_exceeded")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise bad(param, f"'{param}' is not valid Unicode text (a lone surrogate)") from None
    return llm.tokenizer.encode_in_thread(text, special=special)


def check_request_count(count: int, n: int, config) -> None:
    """A request asking for more completions (prompts × n) than the waiting queue holds could never be
    queued, even on an idle server: a 400 naming the limit (not a 429 that retrying cannot cure)."""
    if count * n > config.max_waiting:
        param = "n" if count == 1 else "prompt"
        raise bad(param, f"this request asks for {count * n} completions ({count} prompt(s) × n={n}); this server "
                         f"queues at most {config.max_waiting} (max_waiting, `specmoe serve --max-waiting`)",
                  code="too_many_completions")


def completion_items(body: dict, n: int = 1, config=None) -> list:
    """`prompt`: a string, a list of strings, a list of token ids, or a list of token-id lists, as one item per
    prompt (not tokenized). With `config`, more prompts × `n` than its queue holds are refused."""
    p = body.get("prompt")
    if isinstance(p, str):
        items = [p]
    elif isinstance(p, list) and p and all(_is_int(t) for t in p):
        items = [p]
    elif isinstance(p, list) and p and all(isinstance(x, str) or (isinstance(x, list) and all(_is_int(t) for t in x))
                                           for x in p):
        items = p
    else:
        got = "missing" if p is None else f"{type(p).__name__} {p!r}"[:80]
        raise bad("prompt", "'prompt' must be a string, a list of strings, a list of token ids or a list of "
                            f"token-id lists; got {got}")
    if config is not None:
        check_request_count(len(items), n, config)
    return items


def completion_prompts(body: dict, llm, n: int = 1, config=None) -> list[tuple[str | None, list[int]]]:
    """(text or None, token ids) per prompt (`completion_items`), each checked against the model."""
    out = []
    for x in completion_items(body, n, config):
        ids = _encode(llm, x, "prompt") if isinstance(x, str) else list(x)
        _check_ids(ids, "prompt", llm)
        out.append((x if isinstance(x, str) else None, ids))
    return out


def _sampling(c: dict, max_tokens: int) -> SamplingParams:
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=c["temperature"], top_k=c["top_k"],
                              top_p=c["top_p"], seed=c["seed"], stop=c["stop"], ignore_eos=c["ignore_eos"])
    except InputError as e:  # the fields were checked above; this is the engine's own word on them
        raise bad(None, str(e)) from None


def completion_request(body: dict, *, llm, served: str, config) -> GenerationRequest:
    model = check_model(body, served)
    c = _common(body, config)
    lp = body.get("logprobs")
    logprobs = None if lp is None else _int(body, "logprobs", None, lo=0, hi=config.max_logprobs)
    prompts, sources = translation_prompts(body, llm, c["n"], config)
    if prompts is None:
        prompts = completion_prompts(body, llm, c["n"], config)
    params = [_sampling(c, _max_tokens(body, "max_tokens", len(ids), llm.max_model_len,
                                       COMPLETION_DEFAULT_MAX_TOKENS)) for _, ids in prompts]
    return GenerationRequest("completion", model, prompts, params, c["n"], c["stream"], c["include_usage"], logprobs,
                             sources)


def translation_prompts(body: dict, llm, n: int, config):
    """An encoder–decoder (translation) model's completion: `target_lang` (required) and `source_lang` (default
    eng_Latn), language codes; (prompts as (text, decoder prompt), encoder inputs), or (None, None) for a
    decoder-only model (which refuses the two fields)."""
    langs = {k: body.get(k) for k in ("target_lang", "source_lang")}
    for k, v in langs.items():
        if v is not None and not isinstance(v, str):
            raise bad(k, f"'{k}' must be a language code such as 'fra_Latn'")
    try:
        check_translation_args(llm.config, langs["target_lang"], langs["source_lang"], llm.path)
        if llm.config.seq2seq is None:
            return None, None
        reqs = translation_requests(completion_items(body, n, config), langs["target_lang"], langs["source_lang"],
                                    tokenizer=llm.tokenizer, cfg=llm.config, max_model_len=llm.max_model_len,
                                    model_path=llm.path)
    except InputError as e:
        raise bad("target_lang" if "lang" in str(e) else "prompt", str(e)) from None
    return [(r.text, r.prompt_ids) for r in reqs], [r.source_ids for r in reqs]


def chat_messages(body: dict) -> list[dict]:
    """`messages`: a non-empty list of {role, content}; content a string or a list of text parts."""
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("messages", "'messages' must be a non-empty list of {\"role\": ..., \"content\": ...} objects")
    out = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise bad("messages", f"{where} must be an object with a string 'role'")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad("messages", f"{where}.content: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                                          "are supported")
                texts.append(part["text"])
            content = "\n".join(texts)
        elif content is None:
            content = ""
        elif not isinstance(content, str):
            raise bad("messages", f"{where}.content must be a string or a list of text parts")
        out.append({**m, "content": content})
    return out


def chat_request(body: dict, *, llm, served: str, config, template) -> GenerationRequest:
    """`template`: the model's `ChatTemplate` (None: the model has none, which is a 400)."""
    model = check_model(body, served)
    c = _common(body, config)
    msgs = chat_messages(body)
    check_request_count(1, c["n"], config)
    if llm.config.seq2seq is not None:
        raise bad("messages", f"{llm.path} is a translation (encoder–decoder) model: use /v1/completions with "
                              "'target_lang'")
    if template is None:
        raise bad("messages", "this model has no chat template (tokenizer_config.json 'chat_template'); use "
                              "/v1/completions")
    text = template.render(msgs, add_generation_prompt=True)
    ids = _encode(llm, text, "messages", special=False)  # the template writes the special tokens itself
    _check_ids(ids, "messages", llm)
    logprobs = None
    if _bool(body, "logprobs", False):
        logprobs = _int(body, "top_logprobs", 0, lo=0, hi=config.max_logprobs)
    elif body.get("top_logprobs") is not None:
        raise bad("top_logprobs", "'top_logprobs' needs 'logprobs': true")
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    params = [_sampling(c, _max_tokens(body, name, len(ids), llm.max_model_len, None))]
    return GenerationRequest("chat", model, [(text, ids)], params, c["n"], c["stream"], c["include_usage"], logprobs)
