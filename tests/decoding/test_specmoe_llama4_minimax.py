"""Speculative decoding on Llama-4 and MiniMax-M2: greedy output equals plain greedy for the self draft (chains and
token trees; on Llama-4 the verified tokens cross attention-chunk boundaries) and for the n-gram drafter, with drafts
both accepted and rejected; seeded sampled rows equal plain seeded decoding."""
from __future__ import annotations

import random

import pytest

from specmoe import LLM, SamplingParams
from tests.tiny_llama4_minimax import NEW_FAMILIES, checkpoint


def prompts(n: int, seed: int, max_len: int = 14) -> list[list[int]]:
    r = random.Random(seed)
    return [[r.randrange(96) for _ in range(r.randint(1, max_len))] for _ in range(n)]


PROMPTS = prompts(6, 5)
PARAMS = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (16, 3, 9, 16, 7, 12)]
# repetitive prompts: the n-gram lookup finds continuations in them
REPEATS = [[3, 4, 5, 6, 3, 4, 5, 6, 3, 4], [10, 11, 12, 10, 11, 12, 10], [7, 8, 7, 8, 7, 8, 7, 8, 7]]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return lambda family: checkpoint(family, tmp_path_factory)


def accepted_and_rejected(st: dict) -> None:
    assert st["steps"] > 0 and st["drafted_tokens"] > 0
    assert 0 < st["accepted_tokens"] < st["drafted_tokens"], "drafts were both accepted and rejected"


@pytest.mark.parametrize("family", NEW_FAMILIES)
@pytest.mark.parametrize("tree", [False, True])
def test_self_draft_greedy_equals_plain_greedy(ckpt, family, tree):
    path = ckpt(family)
    ref = [o.token_ids for o in LLM(path, decoding="ar").generate(PROMPTS, PARAMS)]
    llm = LLM(path, decoding="specmoe", draft_experts=3, num_draft_tokens=3, substitution="affinity",
              draft_tree=tree)
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == ref
    st = llm.stats
    accepted_and_rejected(st)
    assert st["draft_phase_bytes"] == 0 and 1.0 < st["tokens_per_step"] < 4.0


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_ngram_greedy_equals_plain_greedy(ckpt, family):
    path = ckpt(family)
    ps = REPEATS + PROMPTS[:3]
    sp = SamplingParams(max_tokens=14, ignore_eos=True)
    ref = [o.token_ids for o in LLM(path, decoding="ar").generate(ps, sp)]
    llm = LLM(path, decoding="specmoe", drafter="ngram", num_draft_tokens=3, ngram_min=1, ngram_max=3)
    assert [o.token_ids for o in llm.generate(ps, sp)] == ref
    st = llm.stats
    assert st["drafter"] == "ngram"
    accepted_and_rejected(st)


@pytest.mark.parametrize("family", NEW_FAMILIES)
@pytest.mark.parametrize("drafter", ["self", "ngram"])
def test_seeded_rows_equal_plain_seeded_decoding(ckpt, family, drafter):
    path = ckpt(family)
    ps = REPEATS + PROMPTS[:3]
    seeded = [SamplingParams(max_tokens=12, temperature=0.8, seed=40 + i, ignore_eos=True) for i in range(len(ps))]
    ref = [o.token_ids for o in LLM(path, decoding="ar").generate(ps, seeded)]
    llm = LLM(path, decoding="specmoe", drafter=drafter, draft_experts=3, num_draft_tokens=3, ngram_min=1)
    assert [o.token_ids for o in llm.generate(ps, seeded)] == ref
    assert llm.stats["drafted_tokens"] > 0


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_bf16_self_draft_greedy_equals_plain_greedy(tmp_path_factory, family):
    """bf16 on the CPU: attention takes the batch-invariant fixed split (on Llama-4 with its chunked and full
    masks in one forward), so speculation still equals plain greedy decoding. Ragged verification rows put padding
    queries in chunks past their row's keys: they must see some key, else NaN reaches the KV cache (and the fixed
    split's p·V turns the hidden NaN into NaN logits)."""
    import torch
    path = checkpoint(family, tmp_path_factory, dtype=torch.bfloat16)
    ref = [o.token_ids for o in LLM(path, dtype="bfloat16", decoding="ar").generate(PROMPTS, PARAMS)]
    llm = LLM(path, dtype="bfloat16", decoding="specmoe", draft_experts=3, num_draft_tokens=3)
    assert [o.token_ids for o in llm.generate(PROMPTS, PARAMS)] == ref
    accepted_and_rejected(llm.stats)
