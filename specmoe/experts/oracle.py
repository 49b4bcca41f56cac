"""MoE-Overlap's oracle prefetch: record the union of experts every MoE layer asked for during a run,
then replay an identical run with each next layer's true union prefetched (the best overlap a perfect
predictor could reach on the same I/O channel; an upper bound, used by the benchmarks)."""
from __future__ import annotations

ORACLE_TRACE_MAX = 1 << 17  # recorded (forward, layer) unions: a trace never replayed stops growing here


class OracleTrace:
    def __init__(self):
        self.trace: list[tuple[int, tuple[int, ...]]] = []
        self.replaying = False
        self.pos = 0

    def start_recording(self) -> None:
        self.trace, self.replaying, self.pos = [], False, 0

    def start_replay(self) -> None:
        self.replaying, self.pos = True, 0

    def step(self, layer: int, ids: list[int], next_layer: int | None) -> tuple[tuple[int, list[int]] | None, bool]:
        """A MoE layer asked for `ids`. Recording: remember it. Replaying: (the next layer and its recorded
        union to prefetch, or None; whether this layer's union differs from the recording)."""
        key = (layer, tuple(ids))
        if not self.replaying:
            if len(self.trace) < ORACLE_TRACE_MAX:  # bounded: a replay past the end just stops
                self.trace.append(key)
            return None, False
        tr, i = self.trace, self.pos
        if i < 0:
            return None, False
        if i >= len(tr) or tr[i][0] != layer:  # a different sequence of forwards: stop prefetching
            self.pos = -1
            return None, True
        # same forward, different union: only padding positions of a ragged batch can do this (they attend
        # to stale KV entries); keep replaying, the difference shows as misses / wasted prefetch
        mismatch = tr[i] != key
        self.pos += 1
        if i + 1 < len(tr) and tr[i + 1][0] == next_layer:
            return (tr[i + 1][0], list(tr[i + 1][1])), mismatch
        return None, mismatch
