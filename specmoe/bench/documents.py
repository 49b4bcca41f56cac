"""Held-out natural documents for benchmarks/over_ram.py's natural-forced workload (issue 36).

benchmarks/prompts/<domain>.jsonl holds, per domain, short excerpts (32-96 tokens) of held-out documents, written by
scripts/make_prompts.py sorted by (source document, offset): consecutive lines of a domain are excerpts of the same
source in reading order, at least 400 characters apart (the text between two lines is not in the file). A document
here is consecutive lines of one domain joined by a newline until it holds `prompt_tokens + max_tokens` tokens,
then cut there: the first `prompt_tokens` tokens are the prompt, the next `max_tokens` the forced continuation. It
is natural text of one domain and one source run (not a loop a greedy model falls into), with seams where
excerpts meet; `Document.ids` names the lines it took.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specmoe.errors import InputError

DOMAINS = ("code", "bible", "docs", "fortunes")


@dataclass(frozen=True)
class Document:
    domain: str
    ids: tuple[str, ...]      # the prompt lines it was built from, in order
    prompt: list[int]         # prompt_tokens token ids
    forced: list[int]         # max_tokens token ids: the continuation fed one at a time

    def to_dict(self) -> dict:
        return {"domain": self.domain, "ids": list(self.ids), "prompt": self.prompt, "forced": self.forced}


def read_lines(prompts_dir: Path, domain: str) -> list[dict]:
    path = Path(prompts_dir) / f"{domain}.jsonl"
    if not path.is_file():
        raise InputError(f"no held-out prompts for domain {domain!r}: {path} is missing")
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def build_documents(encode, prompts_dir: Path, *, per_domain: int, prompt_tokens: int, max_tokens: int,
                    domains: tuple[str, ...] = DOMAINS, skip: int = 0) -> list[Document]:
    """`per_domain` documents of each domain (in the order of `domains`, interleaved: d0, d1, ..., d0, d1, ...),
    each `prompt_tokens + max_tokens` tokens (`encode`: text -> token ids) from consecutive lines, no line used
    twice; the first `skip` lines of each domain are left out. Refused (InputError, with the numbers) when a
    domain's lines run out."""
    if per_domain < 1 or prompt_tokens < 1 or max_tokens < 1:
        raise InputError(f"documents need per_domain, prompt_tokens and max_tokens >= 1, got {per_domain}, "
                         f"{prompt_tokens}, {max_tokens}")
    need = prompt_tokens + max_tokens
    by: dict[str, list[Document]] = {}
    for d in domains:
        lines = read_lines(prompts_dir, d)
        docs, i = [], skip
        while len(docs) < per_domain:
            text, ids = "", []
            while i < len(lines) and len(encode(text)) < need:
                text = lines[i]["prompt"] if not ids else text + "\n" + lines[i]["prompt"]
                ids.append(lines[i]["id"])
                i += 1
            toks = encode(text)
            if len(toks) < need:
                raise InputError(f"domain {d!r}: only {len(docs)} documents of {need} tokens from its {len(lines)} "
                                 f"lines (from line {skip}), {per_domain} asked")
            docs.append(Document(d, tuple(ids), list(toks[:prompt_tokens]), list(toks[prompt_tokens:need])))
        by[d] = docs
    return [by[d][k] for k in range(per_domain) for d in domains]
