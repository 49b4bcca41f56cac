"""Forced decoding (`SamplingParams.forced_tokens`, teacher forcing): the output is the forced document, the model
reads every forced token (its log-probabilities equal transformers' teacher-forced forward), every decoding mode gives
the same tokens and scores, speculative modes accept a draft only where it equals the forced token, and a forced row
leaves its batch neighbours' greedy output alone."""
from __future__ import annotations

import pytest
import torch

from specmoe import LLM, SamplingParams
from specmoe.engine.core import Request
from specmoe.errors import InputError

PROMPT = [5, 17, 33, 2, 61, 40, 8, 19]
N = 24


def _run(llm, prompt, sp):
    with llm.engine() as core:
        req = core.add(Request(prompt_ids=prompt, params=sp, logprobs=1))
        while not req.finished:
            core.step()
    return req.output_ids, [lp.logprob for lp in req.token_logprobs]


@pytest.fixture(scope="module")
def case(tiny_ckpt):
    """(path, greedy continuation, forced document): the document follows the model's greedy text for 6 tokens
    (drafts get accepted there), then departs from it (drafts get rejected)."""
    path = tiny_ckpt("qwen3_moe")
    greedy = LLM(path, decoding="ar").generate([PROMPT], SamplingParams(max_tokens=N, ignore_eos=True))[0].token_ids
    doc = greedy[:6] + [(t * 7 + 3) % 90 + 1 for t in greedy[6:]]
    doc[10] = (doc[10] + 11) % 90 + 1
    assert doc != greedy
    return path, greedy, doc


def test_forced_ar_scores_equal_transformers_teacher_forcing(case, hf_model):
    path, _, doc = case
    ids, lps = _run(LLM(path, decoding="ar"), PROMPT, SamplingParams(max_tokens=N, forced_tokens=doc,
                                                                        ignore_eos=True))
    assert ids == doc
    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([PROMPT + doc])).logits[0].float()
    ref = torch.log_softmax(logits, -1)[len(PROMPT) - 1: len(PROMPT) - 1 + N]
    want = ref.gather(1, torch.tensor(doc)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(lps), want, atol=2e-4, rtol=0)


@pytest.mark.parametrize("kw", [
    dict(decoding="specmoe", num_draft_tokens=4),
    dict(decoding="specmoe", num_draft_tokens=3, draft_tree=True, draft_tree_width=3),
    dict(decoding="specmoe", drafter="ngram", num_draft_tokens=4),
    dict(decoding="auto"),
    dict(decoding="specmoe", num_draft_tokens=4, draft_experts=2, offload="host", cache_experts=4, cache_policy="lru"),
], ids=["chain", "tree", "ngram", "auto", "offloaded"])
def test_forced_speculation_equals_forced_ar_and_rejects_off_document_drafts(case, kw):
    path, _, doc = case
    sp = SamplingParams(max_tokens=N, forced_tokens=doc, ignore_eos=True)
    ref_ids, ref_lps = _run(LLM(path, decoding="ar"), PROMPT, sp)
    llm = LLM(path, **kw)
    ids, lps = _run(llm, PROMPT, sp)
    assert ids == ref_ids == doc
    torch.testing.assert_close(torch.tensor(lps), torch.tensor(ref_lps), atol=2e-4, rtol=0)
    st = llm.stats
    if "offload" in kw:
        assert st["expert_bytes_per_token"] > 0, "the offloaded run fetched experts"
    if kw["decoding"] != "auto" and kw.get("drafter") != "ngram":  # self drafts: on the document, then off it
        d = st["drafters"]["self"]
        assert d["accepted_tokens"] > 0, d
        assert d["accepted_tokens"] < d["drafted_tokens"], "off-document drafts must be rejected"


def test_forced_row_leaves_its_neighbours_exact(case):
    path, greedy, doc = case
    other = [3, 3, 9, 71, 12]
    plain = LLM(path, decoding="ar").generate([other], SamplingParams(max_tokens=N, ignore_eos=True))[0].token_ids
    for kw in (dict(decoding="ar"), dict(decoding="specmoe", num_draft_tokens=4)):
        outs = LLM(path, **kw).generate(
            [PROMPT, other], [SamplingParams(max_tokens=N, forced_tokens=doc, ignore_eos=True),
                              SamplingParams(max_tokens=N, ignore_eos=True)])
        assert outs[0].token_ids == doc and outs[1].token_ids == plain, kw


def test_forced_bad_input(case):
    path, _, doc = case
    with pytest.raises(InputError, match="temperature 0"):
        SamplingParams(max_tokens=4, temperature=0.8, forced_tokens=doc)
    with pytest.raises(InputError, match="fewer than max_tokens"):
        SamplingParams(max_tokens=30, forced_tokens=doc)
    with pytest.raises(InputError, match="non-negative token ids"):
        SamplingParams(max_tokens=2, forced_tokens=[1, -4])
    with pytest.raises(InputError, match="outside the vocabulary"):
        LLM(path, decoding="ar").generate([PROMPT], SamplingParams(max_tokens=2, forced_tokens=[1, 10**6]))
