"""The incremental detokenizer against full decoding, on one tokenizer of each kind the families ship
(tests/engine/tokenizer_zoo.py): the text after every token, stop strings (split across tokens, made of
multi-byte characters, never matching) and the pieces a caller sees while a request runs."""
from __future__ import annotations

import random

import pytest

from specmoe.engine.detokenizer import Detokenizer
from tests.engine.tokenizer_zoo import EXTRA, KINDS, corpus, make_tokenizer

FFFD = "\ufffd"


@pytest.fixture(scope="module", params=KINDS)
def tok(request, tmp_path_factory):
    return make_tokenizer(request.param, tmp_path_factory.mktemp(request.param))


def sequences(tok, n_random: int = 40) -> list[list[int]]:
    """Encoded text (the bundled prompts, multi-byte characters) and random ids with special tokens among them."""
    rng = random.Random(0)
    V = tok.tok.get_vocab_size()
    special = sorted(tok.tok.get_added_tokens_decoder())
    seqs = [tok.encode(t) for t in corpus()[::9] + [EXTRA, EXTRA * 2]]
    for _ in range(n_random):
        ids = [rng.randrange(V) for _ in range(rng.randrange(1, 50))]
        for _ in range(rng.randrange(3)):
            ids.insert(rng.randrange(len(ids) + 1), rng.choice(special))
        seqs.append(ids)
    return seqs


def reference(tok, ids: list[int], stops: list[str]) -> tuple[int | None, str]:
    """The rule as full decoding states it: (the token at which a stop string first appears in decode(ids[:k+1]),
    or None; the final text: the full decode up to that token, cut before the first stop string)."""
    for k in range(len(ids)):
        full = tok.decode(ids[:k + 1])
        hits = [full.index(s) for s in stops if s in full]
        if hits:
            return k, full[:min(hits)]
    return None, tok.decode(ids)


def run(tok, ids: list[int], stops: list[str]) -> tuple[int | None, str, list[str]]:
    """Push the tokens as an engine does, taking the visible text after each: (stop token or None, the pieces
    joined, the text shown after each token)."""
    d = Detokenizer(tok, stops)
    pieces, shown = [], []
    for k, t in enumerate(ids):
        if d.push(t):
            pieces.append(d.take(finished=True))
            assert d.text == "".join(pieces)
            return k, "".join(pieces), shown
        pieces.append(d.take(finished=False))
        shown.append("".join(pieces))
    pieces.append(d.take(finished=True))
    assert d.text == "".join(pieces)
    return None, "".join(pieces), shown


def test_text_equals_full_decoding_after_every_token(tok):
    for ids in sequences(tok):
        d = Detokenizer(tok)
        for k, t in enumerate(ids):
            d.push(t)
            assert d.full_text == tok.decode(ids[:k + 1]), (ids[:k + 1], k)


def boundary_stops(tok, ids: list[int]) -> list[str]:
    """Stop strings of the sequence's own text: ones that straddle a token boundary (the text before and after
    it), ones made of multi-byte characters, one that never matches."""
    text = tok.decode(ids)
    out = []
    for k in range(1, len(ids)):
        b = len(tok.decode(ids[:k]))
        s = text[max(0, b - 2): b + 2]
        if len(s) >= 2 and FFFD not in s and text.startswith(tok.decode(ids[:k])):
            out.append(s)
    out = out[::max(1, len(out) // 6)]
    out += [c + d for c, d in zip(text, text[1:]) if ord(c) > 127 and ord(d) > 127 and FFFD not in c + d][:3]
    return out + ["never-matches \x00"]


def test_stop_strings_end_where_full_decoding_finds_them(tok):
    """Each stop string alone, and all at once: the same stop token and final text as full decoding; every
    piece shown while running is a prefix of the final text."""
    checked = 0
    for ids in sequences(tok, n_random=10):
        stops = boundary_stops(tok, ids)
        for group in [[s] for s in stops] + [stops]:
            k, final, shown = run(tok, ids, group)
            assert (k, final) == reference(tok, ids, group), group
            assert all(final.startswith(s) for s in shown)
            assert not any(s in sh for s in group for sh in shown), "a stop string was shown"
            checked += k is not None
    assert checked > 20


def test_multibyte_stop_split_across_byte_tokens(tok):
    """"🎉🙂" in EXTRA: 8 bytes, several byte tokens with the small vocabularies (byte-level BPE, SentencePiece's
    byte fallback), pieces of their own with Unigram and WordPiece."""
    ids = tok.encode(EXTRA)
    k, final, _ = run(tok, ids, ["🎉🙂"])
    assert (k, final) == reference(tok, ids, ["🎉🙂"])
    assert k is not None and final.endswith("emoji ")
    if tok.run_tokens or tok.tok.get_vocab_size() > 1000:  # byte tokens: the stop completes on its last byte
        assert tok.decode(ids[:k]).endswith(FFFD)


def test_cost_per_token_is_independent_of_the_output_length(tok):
    """Tokens decoded per pushed token: the same over 1,000 tokens as over 100 (a full decode per token costs
    O(length)), with a never-matching stop string."""
    ids = [t for text in corpus() for t in tok.encode(text)][:1000]
    calls = []
    decode = tok.decode
    tok.decode = lambda x: calls.append(len(x)) or decode(x)
    try:
        per_token = []
        for n in (100, 1000):
            calls.clear()
            d = Detokenizer(tok, ["never-matches \x00"])
            for t in ids[:n]:
                d.push(t)
                d.take(finished=False)
            per_token.append(sum(calls) / n)
    finally:
        del tok.decode
    assert per_token[1] <= 1.25 * per_token[0] and per_token[1] < 10, per_token


# ---------------------------------------------------------------- the visible-text rule, on the demo tokenizer
@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    return make_tokenizer("byte-level-bpe", tmp_path_factory.mktemp("demo"))


def shown_after(tok, text: str, stops: list[str], finished: bool = False) -> str:
    d = Detokenizer(tok, stops)
    pieces = []
    for t in tok.encode(text):
        d.push(t)
        pieces.append(d.take(False))
    pieces.append(d.take(finished))
    return "".join(pieces)


def test_finished_text_is_cut_at_the_first_stop(demo):
    assert shown_after(demo, "abc<END>def<X>", ["<X>", "<END>"], finished=True) == "abc"
    assert shown_after(demo, "abc", [], finished=True) == "abc"


def test_running_text_withholds_what_may_become_a_stop_or_a_character(demo):
    assert shown_after(demo, "hello <E", ["<END>"]) == "hello "
    assert shown_after(demo, "hello <", ["<END>", "<X>"]) == "hello "
    assert shown_after(demo, "hello", ["<END>"]) == "hello"
    ids = demo.encode("caf🎉")
    assert demo.decode(ids[:-1]).endswith(FFFD), "the emoji spans several tokens"
    d = Detokenizer(demo)
    for t in ids[:-1]:
        d.push(t)
    assert d.take(False) == "caf"  # the incomplete character is withheld
    d.push(ids[-1])
    assert d.take(False) == "🎉"


def test_without_a_tokenizer_there_is_no_text():
    d = Detokenizer(None, ["x"])
    assert not d.push(5) and d.take(True) == "" and d.text == ""
