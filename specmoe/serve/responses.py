"""OpenAI response bodies and stream chunks, and the text of each choice as its tokens arrive.

The text pieces come from the engine core (each request's `Detokenizer`, the rule `LLM.generate` uses for
its final text), so the pieces of a stream add up exactly to the non-streamed text.
"""
from __future__ import annotations

import json
import time
import uuid

from specmoe.engine.core import TokenLogprob
from specmoe.serve.engine import Delta


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class ChoiceText:
    """One choice's tokens, logprobs and the text sent so far; `advance` returns the new text piece. `decode`
    gives a token's own text (the logprobs' tokens)."""

    def __init__(self, decode):
        self.decode = decode
        self.ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.sent = ""
        self.finish_reason: str | None = None

    def advance(self, d: Delta) -> str:
        self.ids += d.token_ids
        self.logprobs += d.logprobs
        if d.finished:
            self.finish_reason = d.finish_reason
        self.sent += d.text
        return d.text

    def token_text(self, t: int) -> str:
        return self.decode([t])


def completion_logprobs(ct: ChoiceText, lps: list[TokenLogprob], offset: int) -> dict:
    """Completions' logprobs object for tokens `lps`, text offsets counted from `offset`."""
    tokens, offsets, pos = [], [], offset
    for lp in lps:
        s = ct.token_text(lp.token_id)
        tokens.append(s)
        offsets.append(pos)
        pos += len(s)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in lps],
            "top_logprobs": [{ct.token_text(t): v for t, v in lp.top} for lp in lps], "text_offset": offsets}


def chat_logprobs(ct: ChoiceText, lps: list[TokenLogprob]) -> dict:
    def entry(t, v):
        s = ct.token_text(t)
        return {"token": s, "logprob": v, "bytes": list(s.encode("utf-8"))}
    return {"content": [{**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
                        for lp in lps]}


def finish_reason(d: Delta) -> str | None:
    return d.finish_reason if d.finish_reason in ("stop", "length") else None


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class Responder:
    """Builds the bodies of one API call (kind "completion" or "chat")."""

    def __init__(self, kind: str, model: str):
        self.kind, self.model = kind, model
        self.id = new_id("cmpl" if kind == "completion" else "chatcmpl")
        self.created = int(time.time())
        self.object = "text_completion" if kind == "completion" else "chat.completion"

    def full(self, choices: list[ChoiceText], logprobs: bool, prompt_tokens: int) -> dict:
        out = []
        for i, c in enumerate(choices):
            if self.kind == "completion":
                lp = completion_logprobs(c, c.logprobs, 0) if logprobs else None
                out.append({"index": i, "text": c.sent, "logprobs": lp, "finish_reason": c.finish_reason})
            else:
                lp = chat_logprobs(c, c.logprobs) if logprobs else None
                out.append({"index": i, "message": {"role": "assistant", "content": c.sent}, "logprobs": lp,
                            "finish_reason": c.finish_reason})
        return {"id": self.id, "object": self.object, "created": self.created, "model": self.model,
                "choices": out, "usage": usage(prompt_tokens, sum(len(c.ids) for c in choices))}

    def chunk(self, choices: list[dict], usage_: dict | None = None, with_usage: bool = False) -> str:
        body = {"id": self.id, "object": self.object + ("" if self.kind == "completion" else ".chunk"),
                "created": self.created, "model": self.model, "choices": choices}
        if with_usage:
            body["usage"] = usage_
        return sse(body)

    def delta_choice(self, index: int, c: ChoiceText, piece: str, d: Delta, logprobs: bool, offset: int) -> dict:
        fr = finish_reason(d) if d.finished else None
        if self.kind == "completion":
            lp = completion_logprobs(c, d.logprobs, offset) if logprobs else None
            return {"index": index, "text": piece, "logprobs": lp, "finish_reason": fr}
        delta = {"content": piece} if piece else {}
        lp = chat_logprobs(c, d.logprobs) if logprobs else None
        return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": fr}


def sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


DONE = "data: [DONE]\n\n"
