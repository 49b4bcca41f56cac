"""Held-out perplexity of a model as specmoe computes it (`LLM.logits`), so a quantized expert format is
measured exactly as it decodes.

The texts are the bundled held-out prompts (`benchmarks/prompts/<domain>.jsonl`, text the demo model
was not trained on) or any JSONL file of {"prompt": text} rows. Each text is scored on its own: the
mean negative log-likelihood of every token given the tokens before it (the first token is context only),
averaged over all scored tokens; perplexity = exp(mean NLL).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from tqdm import tqdm

from specmoe.errors import InputError


def load_texts(path: Path | None = None, *, per_domain: int | None = None) -> list[str]:
    """Texts of a JSONL file, or of every `<domain>.jsonl` in the bundled held-out prompts folder (the first
    `per_domain` of each)."""
    from specmoe.bundled import prompts_dir
    files = [Path(path)] if path is not None else sorted(prompts_dir().glob("*.jsonl"))
    if not files or not all(f.is_file() for f in files):
        raise InputError(f"no held-out texts found ({path or prompts_dir()}); pass a JSONL file of "
                         "{\"prompt\": text} rows")
    texts = []
    for f in files:
        rows = []
        for i, line in enumerate(f.read_text(encoding="utf-8").splitlines()):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                raise InputError(f"{f}:{i + 1}: not valid JSON") from None
            text = row.get("prompt", row.get("text")) if isinstance(row, dict) else None
            if not isinstance(text, str):
                raise InputError(f"{f}:{i + 1}: expected an object with a 'prompt' (or 'text') string")
            rows.append(text)
        texts += rows[:per_domain] if per_domain else rows
    return texts


def perplexity(llm, token_lists: list[list[int]], *, batch: int = 16, progress: bool = False) -> dict:
    """{"tokens": scored tokens, "nll": mean NLL (nats), "perplexity": exp(nll)} of `llm` on `token_lists`."""
    seqs = [t for t in token_lists if len(t) >= 2]
    if not seqs:
        raise InputError("perplexity needs at least one text of two or more tokens")
    total, n = 0.0, 0
    with tqdm(total=len(seqs), desc="perplexity", unit="text", disable=not progress, leave=False) as bar:
        for i in range(0, len(seqs), batch):
            chunk = seqs[i:i + batch]
            logits = llm.logits(chunk)  # [b, T, V] fp32
            for b, ids in enumerate(chunk):
                lp = torch.log_softmax(logits[b, : len(ids) - 1].double(), dim=-1)
                tgt = torch.tensor(ids[1:], device=lp.device)
                total -= float(lp.gather(1, tgt[:, None]).sum())
                n += len(ids) - 1
            bar.update(len(chunk))
    nll = total / n
    return {"tokens": n, "nll": nll, "perplexity": math.exp(nll)}


def compare_formats(model, formats: list[str], *, texts: list[str], dtype: str = "auto", repack_dir=None,
                    max_tokens: int = 256, progress: bool = False) -> list[dict]:
    """Perplexity of the model with each expert format (resident experts, decoded as any tier decodes them),
    and the relative change against the first format."""
    from specmoe import LLM
    rows = []
    for fmt in formats:
        llm = LLM(model, dtype=dtype, expert_format=fmt, repack_dir=repack_dir, progress=progress)
        if llm.tokenizer is None:
            raise InputError(f"{llm.path} has no tokenizer: perplexity needs one to read the texts")
        ids = [llm.tokenizer.encode(t)[:max_tokens] for t in texts]
        r = perplexity(llm, ids, progress=progress)
        rows.append({"expert_format": fmt, "dtype": str(llm.dtype).replace("torch.", ""), **r,
                     "bytes_per_expert": _stored_bytes(llm, fmt)})
        llm.close()
    base = rows[0]["perplexity"]
    for r in rows:
        r["change_vs_first"] = r["perplexity"] / base - 1.0
    return rows


def _stored_bytes(llm, fmt: str) -> int:
    from specmoe.experts.formats import ExpertShape, make_format
    return make_format(fmt, ExpertShape.of(llm.config), llm.ckpt.storage_dtype).stored_bytes
