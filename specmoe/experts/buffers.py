"""Expert-sized rows the cache allocates: slot rows and the few scratch rows a fetch spills into.

A fetch whose union of experts outgrows a layer's slots does not allocate: the experts that
found no slot stream through a fixed pool of scratch rows (allocated once with the cache and
counted against the budget), each row reused as soon as the compute handed it back.
"""
from __future__ import annotations

from collections import deque

import torch

from specmoe.memory import aligned_empty


def alloc_rows(n: int, row_bytes: int, device: torch.device) -> torch.Tensor:
    """[n, row_bytes] uint8; on CPU aligned so the disk tier reads straight into a row."""
    if device.type == "cuda":
        return torch.empty(n, row_bytes, dtype=torch.uint8, device=device)
    return aligned_empty(n * row_bytes).view(n, row_bytes)


def compute_mark(device: torch.device):
    """CUDA: an event after the compute queued so far (it read a row just handed back); None on CPU."""
    if device.type != "cuda":
        return None
    ev = torch.cuda.Event()
    ev.record(torch.cuda.current_stream(device))
    return ev


class Spill:
    """One fetch's experts without a slot, loaded in turn through rows taken from `pool`.

    `submit(e, row, after)` queues a load (`after`: CUDA event the copy must wait for, None for the
    default); `pop()` gives the next (expert, row, future); `done(row)` hands a row back once the
    compute read it, which starts the next load; `close()` waits for loads in flight and returns
    the rows to the pool."""

    def __init__(self, pool: list[torch.Tensor], ids: list[int], submit, device: torch.device):
        self.pool, self.submit, self.device = pool, submit, device
        self.taken = pool[: len(ids)]
        del pool[: len(self.taken)]
        assert self.taken or not ids, "no free scratch row: an earlier fetch generator was left open"
        self.spare, self.later, self.inflight = list(self.taken), list(ids), deque()
        self._load(None)

    def _load(self, after) -> None:
        while self.later and self.spare:
            e, row = self.later.pop(0), self.spare.pop()
            self.inflight.append((e, row, self.submit(e, row, after)))

    def __bool__(self) -> bool:
        return bool(self.inflight)

    def pop(self):
        return self.inflight.popleft()

    def done(self, row: torch.Tensor) -> None:
        self.spare.append(row)
        self._load(compute_mark(self.device))

    def close(self) -> None:
        for _, _, fut in self.inflight:
            fut.exception()  # never hand back a row a transfer is still writing
        self.inflight.clear()
        self.pool += self.taken
        self.taken = []


def expert_views(packed: torch.Tensor, cfg) -> tuple:
    """Typed experts packed [S, ≥ expert numel] as [gate (I·D); up (I·D); down (D·I)] (+ [gate bias (I); up bias
    (I); down bias (D)] with `cfg.expert_bias`; not gated: [fc1; fc2] (+ biases), gate_up then [S, I, D]) per row, row
    stride free → views gate_up [S, 2I, D], down
    [S, D, I], gate_up bias [S, 2I] or None, down bias [S, D] or None (no copy)."""
    D, I = cfg.hidden_size, cfg.expert_intermediate_size
    g = 2 * I if cfg.gated_experts else I  # rows of the input projection (NLLB-MoE: fc1 alone, [S, I, D])
    w = g * D + D * I
    gate_up, down = packed[:, : g * D].unflatten(1, (g, D)), packed[:, g * D: w].unflatten(1, (D, I))
    if not cfg.expert_bias:
        return gate_up, down, None, None
    return gate_up, down, packed[:, w: w + g], packed[:, w + g: w + g + D]


def slot_views(fmt, rows: torch.Tensor, nbytes: int, dtype: torch.dtype, cfg) -> tuple:
    """Slots (uint8 rows [S, row bytes]) as the MoE block reads them: a quantized format's stored bytes
    (`dtype` STORED: `fmt.stored_views`, with their scales) or experts in a float dtype (`expert_views`)."""
    if dtype == torch.uint8:
        return fmt.stored_views(rows)
    return expert_views(typed_rows(rows, nbytes, dtype), cfg)


def typed_rows(rows: torch.Tensor, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
    """uint8 rows [S, row bytes] → their first `nbytes` as `dtype` [S, nbytes / element size] (a view)."""
    return rows[:, :nbytes].view(dtype)
