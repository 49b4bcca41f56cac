"""N-gram drafting against a brute-force search written from the definition."""
import random

import pytest

from specmoe.decoding.drafters.ngram import NgramIndex, propose


def brute(tokens, k, n_min, n_max):
    L = len(tokens)
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = tokens[L - n:]
        for end in range(L - 2, n - 2, -1):  # latest earlier occurrence ending at `end` <= L-2
            if tokens[end - n + 1: end + 1] == suffix:
                return tokens[end + 1: min(end + 1 + k, L)]
    return []


@pytest.mark.parametrize("vocab", [2, 3, 8])
def test_incremental_index_matches_brute_force(vocab):
    rng = random.Random(vocab)
    for trial in range(40):
        n_min = rng.randint(1, 3)
        n_max = rng.randint(n_min, 5)
        idx = NgramIndex(n_min, n_max)
        hist = []
        for _ in range(rng.randint(1, 60)):  # grow the history in chunks, proposing in between
            chunk = [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
            hist += chunk
            idx.extend(chunk)
            k = rng.randint(1, 6)
            assert idx.propose(k) == brute(hist, k, n_min, n_max)
        assert propose(hist, 3, n_min, n_max) == brute(hist, 3, n_min, n_max)


def brute_many(tokens, k, width, n_min, n_max, keep=NgramIndex.KEEP):
    L, out = len(tokens), []
    for n in range(min(n_max, L - 1), n_min - 1, -1):
        suffix = tokens[L - n:]
        ends = [e for e in range(L - 2, n - 2, -1) if tokens[e - n + 1: e + 1] == suffix][:keep]  # latest first
        for end in ends:
            cont = tokens[end + 1: min(end + 1 + k, L)]
            if cont and not any(c[:len(cont)] == cont for c in out):
                out.append(cont)
                if len(out) == width:
                    return out
    return out


@pytest.mark.parametrize("vocab", [2, 3, 8])
def test_trees_after_chains_see_every_older_occurrence(vocab):
    """Chains index only the latest occurrence (a whole run at a time); the first tree re-indexes the history
    with the older ones, and both keep matching the definition from then on."""
    rng = random.Random(100 + vocab)
    for trial in range(30):
        n_min = rng.randint(1, 3)
        n_max = rng.randint(n_min, 5)
        idx = NgramIndex(n_min, n_max)
        hist, switch = [], rng.randint(0, 30)
        for step in range(rng.randint(1, 50)):
            chunk = [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
            hist += chunk
            idx.extend(chunk)
            k = rng.randint(1, 6)
            if step < switch:
                assert idx.propose(k) == brute(hist, k, n_min, n_max) and not idx.keep_older
            else:
                width = rng.randint(2, 4)
                assert idx.propose_many(k, width) == brute_many(hist, k, width, n_min, n_max)
                assert idx.keep_older and idx.propose(k) == brute(hist, k, n_min, n_max)


def test_repeated_text_is_proposed_and_fresh_text_is_not():
    text = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7]
    assert propose(text, 4) == [8, 9, 1, 2]  # longest match (5 6 7) continues with 8 9 1 2
    assert propose([1, 2, 3, 4, 5], 4) == []
    assert propose([1, 1], 4, n_min=1) == [1]  # continuation stops at the end of the history


def test_bad_bounds():
    with pytest.raises(ValueError):
        NgramIndex(3, 2)
