"""The held-out prompts and batches the eagle drafter's tests run (batch 1, 7 ragged, 64)."""
from __future__ import annotations

import json
from pathlib import Path

from specmoe import SamplingParams

PROMPTS = Path(__file__).resolve().parents[2] / "benchmarks" / "prompts"


def prompts(n: int) -> list[str]:
    out = []
    for dom in ("bible", "code", "docs", "fortunes"):
        out += [json.loads(line)["prompt"] for line in (PROMPTS / f"{dom}.jsonl").read_text().splitlines()[:16]]
    return out[:n]


BATCHES = {
    1: (prompts(1), SamplingParams(max_tokens=40, ignore_eos=True)),
    7: (prompts(7), [SamplingParams(max_tokens=m, ignore_eos=True) for m in (1, 3, 8, 13, 21, 30, 40)]),
    64: (prompts(64), SamplingParams(max_tokens=10, ignore_eos=True)),
}
