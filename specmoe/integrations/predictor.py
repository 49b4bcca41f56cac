"""One engine per worker: rows in, rows out. The stateful predictor that Ray Data's `map_batches` runs
(`specmoe.integrations.ray`), also run in-process by `specmoe batch --num-workers 0`.

A row holds `prompt` (text, or a list of token ids) or `token_ids`, optionally the sampling fields of
SAMPLING_FIELDS (which override the run's defaults for that row) and an `index` that the output row
keeps. `specmoe batch` sends its rows as {"index", "request": the fields as JSON text, "bad": why the
input row could not be read, or None}, so that rows of any types share one Arrow schema in transit.
Each output row (OUTPUT_FIELDS) carries the generated `text`, `token_ids` and `finish_reason`, or an
`error` (empty prompt, prompt over the context, a bad sampling value...): a bad row never fails the batch.

Per-row expert traffic: the engine fetches each MoE layer's expert union once for the whole running
batch, so bytes are not owned by one row. `expert_bytes` is the batch's bytes moved (prefill and
decode) apportioned to its rows by generated tokens (largest remainder: the rows' values add up exactly
to the batch's bytes); `tokens_per_step` is the batch's τ (SpecMoE / auto decoding; None for AR)."""
from __future__ import annotations

import json
import os
import socket

from specmoe.errors import InputError, SpecMoEError

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_k", "top_p", "seed", "stop")
OUTPUT_FIELDS = ("index", "text", "token_ids", "finish_reason", "prompt_tokens", "generated_tokens",
                 "expert_bytes", "tokens_per_step", "worker", "error")


def output_schema():
    """The pyarrow schema of predictor output rows (fixed, so an all-error batch has the same types)."""
    import pyarrow as pa
    return pa.schema([("index", pa.int64()), ("text", pa.string()), ("token_ids", pa.list_(pa.int64())),
                      ("finish_reason", pa.string()), ("prompt_tokens", pa.int64()),
                      ("generated_tokens", pa.int64()), ("expert_bytes", pa.int64()),
                      ("tokens_per_step", pa.float64()), ("worker", pa.string()), ("error", pa.string())])


def apportion(total: int, weights: list[int]) -> list[int]:
    """Split the integer `total` in proportion to `weights` (largest remainder): the parts add up to total."""
    w = sum(weights)
    if not weights:
        return []
    if w == 0:
        weights, w = [1] * len(weights), len(weights)
    parts = [total * x // w for x in weights]
    left = total - sum(parts)
    for i in sorted(range(len(weights)), key=lambda i: -(total * weights[i] % w))[:left]:
        parts[i] += 1
    return parts


def _row_message(e: SpecMoEError) -> str:
    """The engine's message for a one-prompt batch names 'prompt 0'; in a row it is 'the prompt'."""
    msg = str(e)
    return "the prompt" + msg[len("prompt 0"):] if msg.startswith("prompt 0") else msg


class SpecMoEPredictor:
    """`SpecMoEPredictor(llm={...LLM keywords}, defaults={...SamplingParams fields})`; call it on a pyarrow
    Table of rows (Ray Data, batch_format="pyarrow") or use `predict_rows` on a list of dicts.

    Each instance builds one `LLM`, so each worker has its own expert cache and KV cache; with
    offload="disk" the workers read the same repack file (build it before they start:
    `specmoe.integrations.ray.prepare`)."""

    def __init__(self, llm: dict | None = None, defaults: dict | None = None):
        from specmoe.decoding.runtime.sampling import SamplingParams
        from specmoe.engine.llm import LLM
        self.defaults = dict(defaults or {})
        SamplingParams(**self.defaults)  # a bad default is the caller's error, raised here, not per row
        self.llm = LLM(**(llm or {}))
        self.worker = f"{socket.gethostname()}:{os.getpid()}"

    def __call__(self, batch):
        import pyarrow as pa
        return pa.Table.from_pylist(self.predict_rows(batch.to_pylist()), schema=output_schema())

    def close(self) -> None:
        self.llm.close()

    # ---------------------------------------------------------------- rows
    def parse(self, row: dict):
        """(token ids, SamplingParams) of one row; InputError (→ an error row) if it is not usable."""
        from specmoe.decoding.runtime.sampling import SamplingParams
        from specmoe.engine.prompts import normalize_prompts
        if row.get("bad"):
            raise InputError(row["bad"])
        req = json.loads(row["request"]) if row.get("request") is not None else row
        has_prompt, has_ids = req.get("prompt") is not None, req.get("token_ids") is not None
        if has_prompt == has_ids:
            raise InputError("a row needs exactly one of 'prompt' (text or a list of token ids) or 'token_ids'"
                             + (", not both" if has_prompt else ""))
        prompt = req["prompt"] if has_prompt else req["token_ids"]
        if not isinstance(prompt, (str, list)) or (has_ids and not isinstance(prompt, list)):
            want = "a list of integers" if has_ids else "a string or a list of token ids"
            raise InputError(f"'{'token_ids' if has_ids else 'prompt'}' must be {want}, got "
                             f"{type(prompt).__name__}")
        if prompt == "":  # the engine would complete it from BOS alone; in a data file it is a missing prompt
            raise InputError("the prompt is empty")
        kw = {**self.defaults, **{k: req[k] for k in SAMPLING_FIELDS if req.get(k) is not None}}
        params = SamplingParams(**kw)  # InputError naming the field
        m = self.llm
        try:
            _, ids = normalize_prompts([prompt], tokenizer=m.tokenizer, vocab_size=m.config.vocab_size,
                                       max_model_len=m.max_model_len, model_path=m.path)
        except InputError as e:
            raise InputError(_row_message(e)) from None
        return ids[0], params

    def predict_rows(self, rows: list[dict]) -> list[dict]:
        """Output rows (OUTPUT_FIELDS) for rows, in the same order."""
        out: list[dict | None] = [None] * len(rows)
        good = []
        for k, r in enumerate(rows):
            try:
                ids, params = self.parse(r)
            except (SpecMoEError, ValueError) as e:  # ValueError: the request is not JSON
                out[k] = self._error(r.get("index"), _row_message(e) if isinstance(e, SpecMoEError)
                                     else f"unreadable request: {e}")
                continue
            good.append((k, ids, params))
        for (k, _, _), row in zip(good, self._generate(good)):
            out[k] = {**row, "index": rows[k].get("index")}
        return out

    def _generate(self, group: list[tuple]) -> list[dict]:
        """One `generate` over the group; if the engine refuses the batch (e.g. its KV cache does not fit),
        each row alone, so only the rows that fail alone become error rows."""
        if not group:
            return []
        llm = self.llm
        before = llm.stats.get("bytes_moved", 0)
        try:
            outs = llm.generate([ids for _, ids, _ in group], [p for _, _, p in group])
        except SpecMoEError as e:
            if len(group) == 1:
                return [self._error(None, _row_message(e))]
            return [row for item in group for row in self._generate([item])]
        s = llm.stats
        tau = s.get("tokens_per_step")
        shares = apportion(s.get("bytes_moved", 0) - before, [len(o.token_ids) for o in outs])
        return [{"index": None, "text": o.text, "token_ids": list(o.token_ids), "finish_reason": o.finish_reason,
                 "prompt_tokens": len(ids), "generated_tokens": len(o.token_ids), "expert_bytes": b,
                 "tokens_per_step": tau, "worker": self.worker, "error": None}
                for (_, ids, _), o, b in zip(group, outs, shares)]

    def _error(self, index: int | None, message: str) -> dict:
        return {"index": index, "text": None, "token_ids": None, "finish_reason": None, "prompt_tokens": None,
                "generated_tokens": 0, "expert_bytes": 0, "tokens_per_step": None, "worker": self.worker,
                "error": message}
