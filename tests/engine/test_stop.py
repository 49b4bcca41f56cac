"""Stop strings, for plain and speculative decoding: output ends exactly where the stop string first
appears, and a stop inside an accepted draft run drops the rest of the run and rolls its K/V back."""
from __future__ import annotations

import pytest

from specmoe import LLM, SamplingParams
from specmoe.engine.core import EngineCore

PROMPTS = ["def parse_header(line):", "And God said,", "The json module"]
MAX = 40


def _record_appends(monkeypatch):
    """Wrap EngineCore._append: record (seq, tokens, kept) and check the KV invariant after every call."""
    calls = []
    orig = EngineCore._append

    def wrapped(self, r, tokens):
        s = r.seq
        before = len(s.output_ids)
        update = orig(self, r, tokens)
        kept = len(s.output_ids) - before
        calls.append((s.seq_id, list(tokens), kept, s.finish_reason))
        # Sequence invariant: the cache holds every token but the last (the pending one)
        assert self.cache.lengths[s.slot] == s.num_tokens - 1, "K/V of dropped tokens must be rolled back"
        return update
    monkeypatch.setattr(EngineCore, "_append", wrapped)
    return calls


@pytest.fixture(scope="module")
def reference():
    llm = LLM(dtype="float32", threads=1)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=MAX, ignore_eos=True))
    return llm, outs


def _find_stop(llm, token_ids, run_starts):
    """A stop string completed by a token strictly inside an emitted multi-token run (not its last token),
    not present in the text before that token: (stop, index of that token)."""
    for start, length in run_starts:
        for k in range(start, start + length - 1):
            before, upto = llm.tokenizer.decode(token_ids[:k]), llm.tokenizer.decode(token_ids[:k + 1])
            piece = upto[len(before):] if upto.startswith(before) else ""
            if len(piece.strip()) >= 2 and piece not in before:
                return piece, k
    return None


def test_stop_string_inside_an_accepted_draft_run_truncates_there(reference, monkeypatch):
    ref_llm, ref = reference
    spec = LLM(dtype="float32", threads=1, decoding="specmoe", draft_experts=4, num_draft_tokens=4)
    calls = _record_appends(monkeypatch)
    outs = spec.generate(PROMPTS, SamplingParams(max_tokens=MAX, ignore_eos=True))
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    found = None
    for i in range(len(PROMPTS)):
        runs, pos = [], 0
        for sid, toks, kept, _ in calls:
            if sid == i:
                runs.append((pos, kept))
                pos += kept
        found = _find_stop(spec, ref[i].token_ids, [r for r in runs if r[1] >= 3])
        if found:
            break
    assert found, "no multi-token accepted run to place a stop string in"
    stop, k = found
    calls.clear()
    params = [SamplingParams(max_tokens=MAX, ignore_eos=True, stop=[stop] if j == i else []) for j in range(3)]
    for llm in (ref_llm, spec):  # the same batch as the recorded run, so its steps are the same
        out = llm.generate(PROMPTS, params)[i]
        full = ref[i].text
        assert out.finish_reason == "stop"
        assert out.token_ids == ref[i].token_ids[:k + 1], "ends at the token that completes the stop string"
        assert out.text == full[:full.index(stop)], "text ends right before the stop string"
    dropped = [c for c in calls if c[2] < len(c[1]) and c[3] == "stop"]
    assert dropped, "the speculative step emitted tokens past the stop; they must have been dropped"


def test_stop_string_ar_and_specmoe_sampled_seeded(reference):
    """Seeded sampling: plain and speculative runs stop at the same place with the same text."""
    sp = SamplingParams(max_tokens=MAX, temperature=0.8, seed=5, stop=["\n", "."])
    a = LLM(dtype="float32", threads=1).generate(PROMPTS, sp)
    b = LLM(dtype="float32", threads=1, decoding="specmoe").generate(PROMPTS, sp)
    assert [(o.token_ids, o.text, o.finish_reason) for o in a] == [(o.token_ids, o.text, o.finish_reason) for o in b]
    for o in a:
        assert "\n" not in o.text and "." not in o.text
    assert any(o.finish_reason == "stop" for o in a)
