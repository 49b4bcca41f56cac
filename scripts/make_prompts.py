#!/usr/bin/env python3
"""Write benchmarks/prompts/{code,docs,bible,fortunes}.jsonl from the HELD-OUT split only.

Each line: {"id": "<domain>-NNNN", "domain": "<domain>", "prompt": "<text>"}; a prompt is a
contiguous excerpt of one held-out document, 32-96 tokens long, never the whole document, (tokenizer of the demo model),
cut at a line boundary (or, failing that, before a space) so it never ends in a partial word.
Deterministic (seeded); --n prompts per domain (default 240).

Usage: .venv/bin/python scripts/make_prompts.py [--corpus data/corpus] [--n 240]
"""
from __future__ import annotations

import argparse
import json
import os
import random

from tokenizers import Tokenizer

DOMAINS = ["code", "docs", "bible", "fortunes"]
MIN_TOK, MAX_TOK = 32, 96


def cut(tok: Tokenizer, text: str, target: int) -> str | None:
    """Prefix of `text` with about `target` tokens, cut at a newline or before a space."""
    ids = tok.encode(text).ids
    # always leave >= 8 tokens of the document after the prompt (something to continue)
    target = min(target, len(ids) - 8)
    if target < MIN_TOK:
        return None
    pre = tok.decode(ids[:target])
    if "\ufffd" in pre[-2:]:
        pre = pre[:-2]
    if True:
        nl = pre.rstrip("\n").rfind("\n")
        sp = pre.rstrip().rfind(" ")
        if nl > 0 and len(tok.encode(pre[:nl]).ids) >= MIN_TOK:
            pre = pre[:nl]
        elif sp > 0:
            pre = pre[:sp]
    pre = pre.rstrip(" \t")
    n = len(tok.encode(pre).ids)
    if not (MIN_TOK <= n <= MAX_TOK) or not pre.strip():
        return None
    return pre


def starts(text: str, domain: str) -> list[int]:
    """Candidate start offsets (line starts) inside a document."""
    if domain == "fortunes":
        return [0]
    offs = [0]
    i = text.find("\n")
    while i != -1 and i + 1 < len(text):
        offs.append(i + 1)
        i = text.find("\n", i + 1)
    # skip blank-line starts
    return [o for o in offs if text[o:o + 1] not in ("\n", "")]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", default="data/corpus")
    ap.add_argument("--tokenizer", default="models/specmoe-tiny-moe/tokenizer.json")
    ap.add_argument("--out", default="benchmarks/prompts")
    ap.add_argument("--n", type=int, default=240)
    ap.add_argument("--seed", type=int, default=1234)
    args = ap.parse_args()
    tok = Tokenizer.from_file(args.tokenizer)
    os.makedirs(args.out, exist_ok=True)
    for dom in DOMAINS:
        rng = random.Random(f"{args.seed}-prompts-{dom}")
        with open(os.path.join(args.corpus, dom, "heldout.jsonl"), encoding="utf-8") as f:
            docs = [json.loads(l) for l in f]
        cands = []  # (doc_idx, start)
        for di, d in enumerate(docs):
            for s in starts(d["text"], dom):
                cands.append((di, s))
        rng.shuffle(cands)
        # spread over documents: round-robin by doc, avoid overlapping starts (>= 400 chars apart)
        used: dict[int, list[int]] = {}
        out = []
        seen = set()
        for di, s in cands:
            if len(out) >= args.n:
                break
            if any(abs(s - u) < 400 for u in used.get(di, [])):
                continue
            target = rng.randint(40, MAX_TOK)
            p = cut(tok, docs[di]["text"][s:], target)
            if p is None or p in seen:
                continue
            seen.add(p)
            used.setdefault(di, []).append(s)
            out.append((di, s, p))
        out.sort()
        path = os.path.join(args.out, f"{dom}.jsonl")
        with open(path, "w", encoding="utf-8") as f:
            for i, (_, _, p) in enumerate(out):
                f.write(json.dumps({"id": f"{dom}-{i:04d}", "domain": dom, "prompt": p}, ensure_ascii=False) + "\n")
        lens = [len(tok.encode(p).ids) for _, _, p in out]
        print(f"{dom:9s} {len(out)} prompts from {len({d for d, _, _ in out})} held-out docs, "
              f"tokens min/mean/max {min(lens)}/{sum(lens) / len(lens):.0f}/{max(lens)} -> {path}")
        if len(out) < 200:
            print(f"WARNING: only {len(out)} prompts for {dom}")


if __name__ == "__main__":
    main()
