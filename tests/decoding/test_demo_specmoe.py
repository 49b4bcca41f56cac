"""SpecMoE on the bundled demo model and its held-out prompts: greedy output equals plain greedy
token for token (fp32), with experts on the SSD tier, and drafting moves no bytes."""
import json
from pathlib import Path

import pytest

from specmoe import LLM, SamplingParams

PROMPTS = Path(__file__).resolve().parents[2] / "benchmarks" / "prompts"


def heldout(n):
    per = {f.stem: [json.loads(line)["prompt"] for line in f.read_text().splitlines()]
           for f in sorted(PROMPTS.glob("*.jsonl"))}
    out = []
    for i in range(n):  # round-robin over domains
        dom = sorted(per)[i % len(per)]
        out.append(per[dom][i // len(per)])
    return out


@pytest.fixture(scope="module")
def reference():
    llm = LLM(dtype="float32", threads=1)
    prompts = heldout(64)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    return prompts, [o.token_ids for o in outs]


@pytest.mark.parametrize("batch,N,gamma,substitution,policy", [
    (1, 4, 4, "affinity", "hot-temporal"),
    (7, 2, 6, "mask", "hot-global"),
    (64, 8, 3, "affinity", "hot-temporal"),
])
def test_demo_model_specmoe_greedy_equals_plain(reference, tmp_path, batch, N, gamma, substitution, policy):
    prompts, ref = reference
    llm = LLM(dtype="float32", offload="disk", repack_dir=str(tmp_path / "repack"), cache_experts=8 + N,
              cache_policy="lru", decoding="specmoe", draft_experts=N, num_draft_tokens=gamma,
              substitution=substitution, draft_policy=policy)
    outs = llm.generate(prompts[:batch], SamplingParams(max_tokens=12, ignore_eos=True))
    assert [o.token_ids for o in outs] == ref[:batch]
    s = llm.stats
    assert s["draft_phase_bytes"] == 0 and s["direct_io"] is True
    assert 1.0 <= s["tokens_per_step"] <= gamma + 1
