"""A request's output text as its tokens arrive, where a stop string ends it, and what a caller may see.

Decoding the whole output again for every token costs O(length) per token (quadratic over a request).
`Detokenizer.push` decodes a window of the last few tokens instead: the tokens whose text was committed
last (`base`, for context) and those after them. The new text is decode(window) minus decode(base part).
It is committed once it ends in a whole character (no trailing U+FFFD: a multi-byte character split across
tokens waits for its last byte) and, with byte-fallback tokenizers, once a run of byte tokens has ended
(`Tokenizer.run_tokens`: such a decoder turns the whole run into text at once). The window then starts at
the tokens just committed, so a decoder's effects at the start of what it decodes (SentencePiece's stripped
first space, WordPiece's first token) fall on both parts alike and cancel; tokens that decode to nothing
(special tokens) keep the older start. A token costs O(window + longest stop string), independent of the
output length.

The rules for the text:
- the text is decode(output ids) (special tokens skipped), as a full decode gives it;
- a stop string ends the request at the token whose text completes it; the final text is cut right before
  the first stop string;
- while a request runs, a caller sees the committed text less a tail that could still grow into a stop
  string, so the pieces `take` returns always add up to the final text.
"""
from __future__ import annotations

from specmoe.tokenizer import Tokenizer

INCOMPLETE = "\ufffd"  # what decoding gives for the bytes of a character whose last bytes have not come yet


class Detokenizer:
    """One request's text. `push` each output token; `take` returns the visible text added since it was last
    called; `stop_at` is where the first stop string starts (None: none so far). Without a tokenizer (a
    checkpoint with token-id prompts only) the text is empty and no stop string matches."""

    def __init__(self, tokenizer: Tokenizer | None, stops: list[str] = ()):
        self.tokenizer, self.stops = tokenizer, [s for s in stops if s]
        self.longest = max(map(len, self.stops), default=0)
        self._stop_chars = set("".join(self.stops))
        self._runs = tokenizer.run_tokens if tokenizer is not None else frozenset()
        self.ids: list[int] = []
        self.stop_at: int | None = None
        self._start = self._read = 0  # window: ids[start:read] decode to `base`; ids[read:] are not committed
        self._base = ""
        self._pieces: list[str] = []  # the committed text, in pieces (joined only for the final text)
        self._n = 0  # its length
        self.pending = ""  # text of ids[read:] as decodable now (may end in an incomplete character)
        self._searched = 0  # committed text before this holds no stop string
        self._shown = 0  # characters `take` has returned

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    # ------------------------------------------------------------ tokens in
    def push(self, token: int) -> bool:
        """Add one output token; True when a stop string has appeared in the text."""
        self.ids.append(token)
        if self.tokenizer is None:
            return False
        text = self._decode(self.ids[self._start:])
        if token not in self._runs and text.startswith(self._base) and not text.endswith(INCOMPLETE):
            self._commit(text[len(self._base):])
            tail = self._decode(self.ids[self._read:])
            if tail:  # the next window starts at the tokens just committed
                self._start, self._base = self._read, tail
            else:  # they decode to nothing: keep the window's start, for its context
                self._base = text
            self._read, self.pending = len(self.ids), ""
        else:
            self.pending = text[len(self._base):]
        return self._find_stop()

    def _commit(self, piece: str) -> None:
        if piece:
            self._pieces.append(piece)
            self._n += len(piece)

    def _tail(self, k: int) -> str:
        """The last k characters of the committed text (O(k): pieces are never empty)."""
        out, need = [], k
        for p in reversed(self._pieces):
            if need <= 0:
                break
            out.append(p[-need:])
            need -= len(p)
        return "".join(reversed(out))

    def _find_stop(self) -> bool:
        if self.stop_at is not None:
            return True
        if not self.stops:
            return False
        start = max(0, self._searched - self.longest + 1)  # an occurrence may end in the new text
        region = self._tail(self._n - start) + self.pending
        hits = [i for i in (region.find(s) for s in self.stops) if i >= 0]
        if hits:
            self.stop_at = start + min(hits)
            return True
        self._searched = self._n  # committed text is final; pending text may still change
        return False

    # ------------------------------------------------------------ text out
    def _hold(self) -> int:
        """Characters at the end of the committed text that could be the start of a stop string."""
        end = self._tail(self.longest - 1)
        if not end or end[-1] not in self._stop_chars:
            return 0
        return max((k for s in self.stops for k in range(1, len(s)) if end.endswith(s[:k])), default=0)

    def _visible_end(self, finished: bool) -> int:
        if self.stop_at is not None:
            return self.stop_at
        if finished:
            return self._n + len(self.pending)
        return self._n - self._hold() if self.stops else self._n

    def take(self, finished: bool) -> str:
        """The visible text added since the last call. Finished: up to the end of the text (cut before the first
        stop string); running: the committed text less a tail that could still become a stop string."""
        end = self._visible_end(finished)
        if end <= self._shown:
            return ""
        if self._shown <= self._n:
            rest = self._tail(self._n - self._shown) + self.pending
        else:
            rest = self.pending[self._shown - self._n:]
        piece = rest[: end - self._shown]
        self._shown = end
        return piece

    @property
    def text(self) -> str:
        """The visible text so far (the final text once the request finished and `take(True)` was called)."""
        return ("".join(self._pieces) + self.pending)[: self._shown]

    @property
    def full_text(self) -> str:
        """decode(ids) as it stands: the committed and the pending text, stop strings included."""
        return "".join(self._pieces) + self.pending
