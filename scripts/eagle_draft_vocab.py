#!/usr/bin/env python3
"""Rank the demo model's tokens by frequency for the EAGLE head's reduced draft vocabulary.

Pipeline position: build_corpus.py -> ... -> train_eagle.py -> THIS (the head is not retrained).

Counts the tokens of the target's greedy continuations of random windows of the corpus's TRAIN split (what
the head learned to predict; benchmarks/prompts come from the held-out split and are never read), ties broken
by the train split's own token counts. Writes `draft_vocab.safetensors` beside the head: `token_ids` [V]
(every target id, most frequent first) and `counts` [V] (float64: greedy count + 1e-6 · corpus count), with
metadata `recommended_size` (the N `eagle_draft_vocab` defaults to; measured with benchmarks/eagle_bench.py).

    .venv/bin/python scripts/eagle_draft_vocab.py --corpus data/corpus [--windows 512] [--recommended 1024]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from train_eagle import token_streams, windows  # noqa: E402

from specmoe import LLM, SamplingParams  # noqa: E402
from specmoe.engine.llm import default_model_path  # noqa: E402
from specmoe.models.eagle import DRAFT_VOCAB  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", default=str(REPO / "data" / "corpus"))
    ap.add_argument("--out", default=str(REPO / "models" / "specmoe-tiny-moe-eagle"))
    ap.add_argument("--windows", type=int, default=512)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=4321)
    ap.add_argument("--recommended", type=int, default=0)
    args = ap.parse_args()
    path = default_model_path()
    llm = LLM(str(path))
    V = llm.config.vocab_size
    streams = token_streams(Path(args.corpus), Path(path) / "tokenizer.json", "train")
    corpus = np.zeros(V)
    for arr in streams.values():
        corpus += np.bincount(arr, minlength=V)[:V]
    rows = windows(streams, args.windows, args.prompt_len, np.random.default_rng(args.seed))
    outs = llm.generate(rows, SamplingParams(max_tokens=args.gen_len, ignore_eos=True), use_tqdm=True)
    greedy = np.zeros(V)
    for o in outs:
        greedy += np.bincount(np.asarray(o.token_ids, dtype=np.int64), minlength=V)[:V]
    counts = greedy + 1e-6 * corpus
    order = np.argsort(-counts, kind="stable")
    from safetensors.torch import save_file
    out = Path(args.out) / DRAFT_VOCAB
    save_file({"token_ids": torch.from_numpy(order.astype(np.int64)), "counts": torch.from_numpy(counts[order])},
              str(out), metadata={"recommended_size": str(args.recommended), "windows": str(args.windows),
                                  "gen_len": str(args.gen_len), "seed": str(args.seed), "source": "train split"})
    cum = np.cumsum(greedy[order]) / greedy.sum()
    for n in (256, 512, 1024, 2048, 4096):
        print(f"top {n}: {cum[n - 1]:.4f} of the greedy tokens")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
