"""N-gram (prompt lookup) drafting: propose what followed the latest earlier occurrence of a sequence's
last n tokens in its own history (prompt + output). Zero compute and zero expert bytes per draft token;
it pays on text that repeats itself (code, extraction, edits of a given text).

`NgramIndex` keeps, per n in [n_min, n_max], a map from each n-gram of the history to the position right
after its latest occurrence, updated incrementally as tokens arrive (O(n_max − n_min + 1) per token), so a
proposal is a few dictionary lookups whatever the history length. The longest matching n wins.
For token trees (`propose_many`) it also keeps, per n-gram, the continuations of up to `KEEP` earlier
occurrences, so several distinct continuations can be proposed at once.
"""
from __future__ import annotations

import torch

from specmoe.decoding.drafters.base import Drafter, DraftHook
from specmoe.decoding.runtime.sequence import Sequence
from specmoe.decoding.trees.tree import DraftTree, trie


class NgramIndex:
    """Incremental n-gram → continuation index over one token history."""
    KEEP = 8  # occurrences remembered per n-gram (the latest + KEEP - 1 older ones)

    def __init__(self, n_min: int = 2, n_max: int = 4):
        if not 1 <= n_min <= n_max:
            raise ValueError(f"need 1 <= n_min <= n_max, got n_min={n_min}, n_max={n_max}")
        self.n_min, self.n_max = n_min, n_max
        self.tokens: list[int] = []
        self.maps: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(n_min, n_max + 1)}
        self.indexed = 0  # n-grams ending before this position are in the maps
        self.older: dict[int, dict[tuple[int, ...], list[int]]] = {n: {} for n in range(n_min, n_max + 1)}
        self.keep_older = False  # older occurrences are indexed once a tree first asks for them

    def extend(self, tokens: list[int]) -> None:
        self.tokens.extend(tokens)

    def _index_upto(self, end: int) -> None:
        """Index every n-gram ending at a position < end (its continuation starts at most at `end`). Until a tree
        first asks for older occurrences (`propose_many` with width > 1) only the latest is kept, indexed a whole
        run of tokens at a time (a prompt of a few hundred tokens in ~0.1 ms instead of ~1 ms)."""
        toks, start = self.tokens, self.indexed
        if end <= start:
            return
        if not self.keep_older:
            for n, m in self.maps.items():
                lo = max(start, n - 1)  # n-grams toks[j-n+1 .. j] for j in [lo, end), continuations at j+1
                if lo < end:
                    grams = zip(*(toks[lo - n + 1 + i: end - n + 1 + i] for i in range(n)))
                    m.update(zip(grams, range(lo + 1, end + 1)))
            self.indexed = end
            return
        for j in range(start, end):  # n-gram toks[j-n+1 .. j], continuation starts at j+1
            for n, m in self.maps.items():
                if j + 1 >= n:
                    key = tuple(toks[j + 1 - n: j + 1])
                    prev = m.get(key)
                    if prev is not None:  # the replaced occurrence joins the older ones (latest first)
                        old = self.older[n].setdefault(key, [])
                        old.insert(0, prev)
                        del old[self.KEEP - 1:]
                    m[key] = j + 1
        self.indexed = end

    def _keep_older(self) -> None:
        """From now on remember up to KEEP occurrences per n-gram: the history indexed again that way."""
        if not self.keep_older:
            self.keep_older, self.indexed = True, 0
            self.maps = {n: {} for n in self.maps}

    def propose(self, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
        L = len(self.tokens)
        if k <= 0 or L < self.n_min + 1:
            return []
        self._index_upto(L - 1)  # the suffix itself (ending at L-1) must match an *earlier* occurrence
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            start = self.maps[n].get(tuple(self.tokens[L - n:]))
            if start is not None:
                return self.tokens[start: min(start + k, L)]
        return []

    def propose_many(self, k: int, width: int) -> list[list[int]]:
        """Up to `width` distinct continuations of at most k tokens, none a prefix of another one taken
        before it: first `propose(k)`'s, then those of older occurrences of the same suffix, then of shorter
        matching suffixes (latest occurrence first)."""
        if width > 1:
            self._keep_older()
        L = len(self.tokens)
        if k <= 0 or width <= 0 or L < self.n_min + 1:
            return []
        self._index_upto(L - 1)
        out: list[list[int]] = []
        for n in range(min(self.n_max, L - 1), self.n_min - 1, -1):
            key = tuple(self.tokens[L - n:])
            latest = self.maps[n].get(key)
            for start in ([] if latest is None else [latest] + self.older[n].get(key, [])):
                cont = self.tokens[start: min(start + k, L)]
                if cont and not any(c[:len(cont)] == cont for c in out):
                    out.append(cont)
                    if len(out) == width:
                        return out
        return out


def propose(history: list[int], k: int, n_min: int = 2, n_max: int = 4) -> list[int]:
    """One-shot form of `NgramIndex.propose` (tests, tools)."""
    idx = NgramIndex(n_min, n_max)
    idx.extend(history)
    return idx.propose(k)


class NgramDrafter(Drafter):
    """Prompt and output lookup: one incremental `NgramIndex` per live sequence, fed the sequence's new
    tokens at each proposal (indexes of sequences no longer in the batch are dropped)."""
    name = "ngram"

    def __init__(self, vocab_size: int, device: torch.device, *, n_min: int = 2, n_max: int = 4):
        self.vocab, self.device = vocab_size, device
        self.n_min, self.n_max = n_min, n_max
        self.index: dict[int, NgramIndex] = {}
        self.owner: dict[int, Sequence] = {}  # the sequence each index was built from
        self.asked = self.proposed = self.empty = 0  # tokens asked for, tokens proposed, rows with none

    def _sync(self, s: Sequence) -> NgramIndex:
        idx = self.index.get(s.seq_id)
        if idx is None or self.owner[s.seq_id] is not s:  # a new sequence (ids may be reused across runs)
            idx = self.index[s.seq_id] = NgramIndex(self.n_min, self.n_max)
            self.owner[s.seq_id] = s
        n = len(idx.tokens)
        P = len(s.prompt_ids)
        if n < P:
            idx.extend(s.prompt_ids[n:])
            n = P
        idx.extend(s.output_ids[n - P:])
        return idx

    def available(self, seqs: list[Sequence], limits: list[int]) -> list[int]:
        """The length of the chain each sequence's lookup would propose now (at most limits[b]): the controller
        plans with it before the step drafts."""
        return [len(self._sync(s).propose(g)) for s, g in zip(seqs, limits)]

    def retire(self, live: set[int]) -> None:
        for sid in [k for k in self.index if k not in live]:
            del self.index[sid], self.owner[sid]

    @torch.inference_mode()
    def propose_tree(self, seqs: list[Sequence], gammas: list[int], width: int, noise: dict[int, torch.Tensor],
                     hook: DraftHook | None = None) -> list[DraftTree]:
        """The trie of up to `width` distinct continuations of the history's matches (`propose_many`; the
        first is the latest occurrence's, the chain). Deterministic drafts: q is one-hot (None) for every row."""
        trees = [trie(self._sync(s).propose_many(g, width)) for s, g in zip(seqs, gammas)]
        got = [len(t) for t in trees]
        self.asked += sum(gammas)
        self.proposed += sum(got)
        self.empty += sum(1 for g, n in zip(gammas, got) if g > 0 and n == 0)
        return trees

    def stats(self) -> dict:
        return {"drafter": self.name, "ngram_min": self.n_min, "ngram_max": self.n_max,
                "draft_tokens_asked": self.asked, "draft_tokens_proposed": self.proposed,
                "empty_proposals": self.empty}
