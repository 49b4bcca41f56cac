"""specmoe.bench.documents: held-out documents for the natural-forced workload, built from consecutive prompt lines
of one domain (lengths, domains interleaved, lines consecutive and never reused, refusal when a domain runs out)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from specmoe.bench.documents import DOMAINS, build_documents, read_lines
from specmoe.errors import InputError

REPO = Path(__file__).resolve().parents[2]


def encode(text: str) -> list[int]:  # one token per character: lengths easy to reason about
    return [ord(c) for c in text]


def fake_prompts(tmp_path: Path, n: int = 6, width: int = 10) -> Path:
    for d in ("a", "b"):
        (tmp_path / f"{d}.jsonl").write_text("".join(
            json.dumps({"id": f"{d}-{i:04d}", "domain": d, "prompt": f"{d}{i}".ljust(width, ".")}) + "\n"
            for i in range(n)))
    return tmp_path


def test_lengths_domains_and_consecutive_lines(tmp_path):
    root = fake_prompts(tmp_path)
    docs = build_documents(encode, root, per_domain=2, prompt_tokens=5, max_tokens=10, domains=("a", "b"))
    assert [d.domain for d in docs] == ["a", "b", "a", "b"]  # interleaved
    for d in docs:
        assert len(d.prompt) == 5 and len(d.forced) == 10
    # 15 tokens need two 10-char lines (+ the newline): lines 0-1, then 2-3, never reused
    assert docs[0].ids == ("a-0000", "a-0001") and docs[2].ids == ("a-0002", "a-0003")
    text = "".join(map(chr, docs[0].prompt + docs[0].forced))
    assert text == ("a0".ljust(10, ".") + "\n" + "a1".ljust(10, "."))[:15]  # lines joined by a newline, cut


def test_a_domain_that_runs_out_is_refused_with_the_numbers(tmp_path):
    root = fake_prompts(tmp_path, n=3)
    with pytest.raises(InputError, match=r"domain 'a': only 1 documents of 15 tokens from its 3 lines"):
        build_documents(encode, root, per_domain=2, prompt_tokens=5, max_tokens=10, domains=("a", "b"))
    with pytest.raises(InputError, match="missing"):
        read_lines(root, "zzz")


def test_the_bundled_prompts_give_eight_documents_of_192_tokens():
    from specmoe.engine.llm import DEMO_MODEL
    from specmoe.tokenizer import Tokenizer
    tok = Tokenizer.load(DEMO_MODEL)
    docs = build_documents(tok.encode, REPO / "benchmarks" / "prompts", per_domain=2, prompt_tokens=32,
                           max_tokens=160)
    assert len(docs) == 8 and sorted({d.domain for d in docs}) == sorted(DOMAINS)
    for d in docs:
        assert len(d.prompt) == 32 and len(d.forced) == 160
        nums = [int(i.split("-")[1]) for i in d.ids]
        assert nums == list(range(nums[0], nums[0] + len(nums)))  # consecutive lines of the file
        assert all(i.startswith(d.domain + "-") for i in d.ids)
