#!/usr/bin/env python3
"""Train the byte-level BPE tokenizer of the specmoe demo model (train split only).

Writes tokenizer.json + tokenizer_config.json + special_tokens_map.json into the model dir.
``<|endoftext|>`` (id 0) is the only special token and serves as bos / eos / pad / unk.
Byte-level with ``add_prefix_space=False`` so ``decode(encode(text)) == text`` exactly.

Usage:  .venv/bin/python scripts/train_tokenizer.py [--corpus data/corpus]
            [--out models/specmoe-tiny-moe] [--vocab 8192]
"""
from __future__ import annotations

import argparse
import json
import os
import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

DOMAINS = ["code", "docs", "bible", "fortunes"]
EOT = "<|endoftext|>"


def iter_train_texts(corpus: str, seed: int = 0):
    # Balanced-ish: every document of every domain once (code/docs are bigger, which is fine
    # for merges; small domains still contribute all their text).
    for dom in DOMAINS:
        with open(os.path.join(corpus, dom, "train.jsonl"), encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)["text"]


def build(vocab: int) -> tuple[Tokenizer, trainers.BpeTrainer]:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        min_frequency=2,
        special_tokens=[EOT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    return tok, trainer


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--corpus", default="data/corpus")
    ap.add_argument("--out", default="models/specmoe-tiny-moe")
    ap.add_argument("--vocab", type=int, default=8192)
    args = ap.parse_args()

    tok, trainer = build(args.vocab)
    tok.train_from_iterator(iter_train_texts(args.corpus), trainer=trainer)
    assert tok.token_to_id(EOT) == 0
    os.makedirs(args.out, exist_ok=True)
    tok.save(os.path.join(args.out, "tokenizer.json"))

    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": EOT,
        "eos_token": EOT,
        "pad_token": EOT,
        "unk_token": EOT,
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1024,  # = max_position_embeddings of the demo model
        "padding_side": "left",
        "added_tokens_decoder": {
            "0": {"content": EOT, "lstrip": False, "normalized": False, "rstrip": False,
                  "single_word": False, "special": True}
        },
    }
    with open(os.path.join(args.out, "tokenizer_config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    with open(os.path.join(args.out, "special_tokens_map.json"), "w") as f:
        json.dump({k: EOT for k in ("bos_token", "eos_token", "pad_token", "unk_token")}, f, indent=2)

    # Round-trip checks with both loaders.
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(args.out)
    raw = Tokenizer.from_file(os.path.join(args.out, "tokenizer.json"))
    samples = [
        "def f(x):\n    return x ** 2  # square\n",
        " leading space and\ttabs\n\n",
        "In the beginning God created the heaven and the earth.",
        "Unicode: naïve café — ünïcödé ✓ 日本語",
        EOT + "after eot",
    ]
    rng = random.Random(0)
    for dom in DOMAINS:
        with open(os.path.join(args.corpus, dom, "heldout.jsonl"), encoding="utf-8") as f:
            lines = f.readlines()
        samples.append(json.loads(rng.choice(lines))["text"])
    n_tok = n_chr = 0
    for s in samples:
        ids = hf(s)["input_ids"]
        assert ids == raw.encode(s).ids, "HF and tokenizers disagree"
        assert hf.decode(ids) == s, f"HF round trip failed: {s[:60]!r}"
        assert raw.decode(ids, skip_special_tokens=False) == s, f"raw round trip failed: {s[:60]!r}"
        n_tok += len(ids)
        n_chr += len(s)
    print(f"vocab={raw.get_vocab_size()} eos_id={hf.eos_token_id} round-trip OK on {len(samples)} samples, "
          f"{n_chr / n_tok:.2f} chars/token on them")
    # chars/token per domain on held-out
    for dom in DOMAINS:
        with open(os.path.join(args.corpus, dom, "heldout.jsonl"), encoding="utf-8") as f:
            texts = [json.loads(l)["text"] for l in f]
        enc = raw.encode_batch(texts)
        nt = sum(len(e.ids) for e in enc)
        nc = sum(len(t) for t in texts)
        print(f"  {dom:9s} held-out: {nt} tokens, {nc / nt:.2f} chars/token")


if __name__ == "__main__":
    main()
