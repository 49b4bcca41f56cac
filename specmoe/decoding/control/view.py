"""What `auto`'s controller is given each step (`StepView`), instead of a reference to the decoder: the sequences
and their draft limits, each drafter's proposal lengths and catch-up entries (read lazily, once, only when a plan
needs them: a reused call reads few), the expert store's resident experts per layer and the drafters' draft
sets."""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from specmoe.decoding.drafters.base import DraftSet


def young_rows(seqs, first: int) -> bool:
    """Whether the rows are, on average, in their first `first` generated tokens, of requests at least 4× as long
    (a request's first tokens run slower on every arm, its experts not cached yet; requests shorter than that are
    all first tokens, and measured as they are)."""
    n = max(len(seqs), 1)
    return (sum(len(s.output_ids) for s in seqs) < first * n
            and sum(s.params.max_tokens for s in seqs) >= 4 * first * n)


@dataclass
class StepView:
    """`seqs` (batch order) and `limits` (the most each may draft); `available(d)` / `catchup(d)`: drafter d's
    `Drafter.available` / `Drafter.catchup` over them; `resident(layer)`: the experts resident there now;
    `draft_sets`: each drafter's `Drafter.draft_set` (drafters with none left out)."""
    seqs: list
    limits: list[int]
    names: tuple[str, ...]  # the decoder's drafters
    available_of: Callable[[str], list[int]]
    catchup_of: Callable[[str], list[int]]
    resident: Callable[[int], Iterable[int]]
    draft_sets: Callable[[], dict[str, DraftSet]]
    _memo: dict = field(default_factory=dict)

    @property
    def seq_ids(self) -> list[int]:
        return [s.seq_id for s in self.seqs]

    def available(self, name: str) -> list[int]:
        return self._once(("available", name), lambda: self.available_of(name))

    def catchup(self, name: str) -> list[int]:
        return self._once(("catchup", name), lambda: self.catchup_of(name))

    def sets(self) -> dict[str, DraftSet]:
        return self._once(("sets",), self.draft_sets)

    def _once(self, key, f):
        if key not in self._memo:
            self._memo[key] = f()
        return self._memo[key]
