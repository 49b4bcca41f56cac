"""One tokenizer of each kind the supported families ship, trained here in a second on the bundled prompts
(no download): the demo model's byte-level BPE (GPT-2 / Qwen / DeepSeek / GPT-OSS style), SentencePiece BPE
with byte fallback (Llama / Mixtral: "▁" for spaces, <0xNN> byte tokens, the decoder strips the first space),
Unigram with Metaspace (SentencePiece unigram) and WordPiece (BERT: "##" continuations, cleanup)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, normalizers, pre_tokenizers, trainers

from specmoe.bundled import demo_model_dir, prompts_dir
from specmoe.tokenizer import Tokenizer

KINDS = ("byte-level-bpe", "sentencepiece-bpe", "unigram", "wordpiece")
SPECIAL = ["<unk>", "<s>", "</s>"]
# multi-byte characters (2, 3 and 4 bytes in UTF-8) that the small vocabularies split into byte tokens
EXTRA = "naïve café — 日本語のテキスト, emoji 🎉🙂 and math ∑∫ done.\n"


def corpus() -> list[str]:
    rows = []
    for f in sorted(prompts_dir().glob("*.jsonl")):
        rows += [json.loads(line)["prompt"] for line in f.read_text().splitlines()[:40]]
    return rows + [EXTRA] * 3


def _train(kind: str) -> HFTokenizer:
    text = corpus()
    if kind == "sentencepiece-bpe":
        t = HFTokenizer(models.BPE(unk_token="<unk>", fuse_unk=True))
        t.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        t.train_from_iterator(text, trainers.BpeTrainer(vocab_size=600, special_tokens=SPECIAL,
                                                        limit_alphabet=60, show_progress=False))
        spec = json.loads(t.to_str())  # add the 256 <0xNN> byte tokens to the model's vocabulary
        vocab = spec["model"]["vocab"]
        for b in range(256):
            vocab.setdefault(f"<0x{b:02X}>", len(vocab))
        spec["model"]["byte_fallback"] = True
        t = HFTokenizer.from_str(json.dumps(spec))
        t.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                       decoders.Strip(" ", 1, 0)])
        return t
    if kind == "unigram":
        t = HFTokenizer(models.Unigram())
        t.pre_tokenizer = pre_tokenizers.Metaspace()
        t.decoder = decoders.Metaspace()
        t.train_from_iterator(text, trainers.UnigramTrainer(vocab_size=500, special_tokens=SPECIAL,
                                                            unk_token="<unk>", show_progress=False))
        return t
    if kind == "wordpiece":
        t = HFTokenizer(models.WordPiece(unk_token="<unk>"))
        t.normalizer = normalizers.BertNormalizer(lowercase=False)
        t.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        t.decoder = decoders.WordPiece(cleanup=True)
        t.train_from_iterator(text, trainers.WordPieceTrainer(vocab_size=600, special_tokens=SPECIAL,
                                                              show_progress=False))
        return t
    raise ValueError(kind)


def make_tokenizer(kind: str, path: Path) -> Tokenizer:
    """A checkpoint-style directory at `path` holding tokenizer.json (+ tokenizer_config.json), loaded."""
    path.mkdir(parents=True, exist_ok=True)
    if kind == "byte-level-bpe":
        for name in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(demo_model_dir() / name, path / name)
    else:
        _train(kind).save(str(path / "tokenizer.json"))
        (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return Tokenizer(path)
