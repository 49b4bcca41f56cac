"""`ExpertStore`: the declared interface between a forward (and the strategies and engine around it)
and wherever expert weights live. `ResidentExperts` and `ExpertCache` implement it; wrappers (the
bench's timer, test doubles) subclass it and delegate explicitly, so no caller ever probes a store
with getattr/hasattr."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator

import torch

from specmoe.errors import InputError
from specmoe.models.moe import Routing, SlotGroup


class ExpertStore(ABC):
    """Contract:

    - `slot_tensors(layer)` is the layer's slot tensors as typed views (gate_up [S, 2I, D], down [S, D, I],
      gate_up / down biases [S, 2I] / [S, D] or None), the
      same tensors for the store's lifetime; `slot_index(layer, ids)` the slot of each resident expert.
    - `fetch(layer, routing)` yields `models.moe.SlotGroup`s (slot tensors + a device map expert -> slot)
      that together hold every expert `routing.needed` names, each once (resident ones first is best),
      each valid until the next group is asked for (the models.moe.ExpertProvider protocol).
    - `pin(layer, ids)` keeps exactly `ids` resident, in fixed slots, from now on (SpecMoE's draft set,
      which the draft reads in place), raising InputError when the store cannot hold them;
      `resident(layer)` is the set that is resident now.
    - `prefetch(layer, ids, keep)` starts loading `ids` (most wanted first) in the background without
      blocking or evicting pinned experts or those in `ids` / `keep`; returns the bytes it started
      loading (0 where everything is resident).
    - `bytes_moved` counts bytes read from the backing tier so far (an integer counter, cheap to read
      inside a step); `lookups` the experts `fetch` was asked for so far (hits + misses, a counter; 0 where
      nothing loads); `fetch_wait_s` the seconds the compute waited for loads; `stats()` is the full
      telemetry dict, for the engine boundary only.
    - `forward_observers` / `forward_layer_hooks`: what the engine registers on its ModelRunner.
    - `device`: where the slot tensors live (routing tensors handed to `fetch` are built there, e.g. by the
      cost model's read calibration); `holds_all`: every expert is resident for good (no union ever needs
      reading to the host).

    Every attribute and method above is the whole interface callers use; `DelegatingStore` forwards each
    one (tests/experts/test_delegating_store.py checks that it overrides every public member declared here).
    """

    forward_observers: list
    forward_layer_hooks: list
    device: torch.device
    holds_all: bool = False

    @abstractmethod
    def fetch(self, layer: int, routing: Routing) -> Iterator[SlotGroup]:
        ...

    @abstractmethod
    def slot_tensors(self, layer: int) -> tuple:
        ...

    @abstractmethod
    def slot_index(self, layer: int, ids: list[int]) -> list[int]:
        ...

    @abstractmethod
    def pin(self, layer: int, ids: list[int]) -> None:
        ...

    @abstractmethod
    def resident(self, layer: int) -> set[int]:
        ...

    def prefetch(self, layer: int, ids: list[int], keep: set[int] = frozenset()) -> int:
        return 0

    def evict_all(self) -> None:
        """Cold cache: drop every expert that is neither pinned nor static (nothing to do when resident)."""

    @property
    def fetch_wait_s(self) -> float:
        """Seconds the compute thread has waited for loads so far (a counter; 0 where nothing loads)."""
        return 0.0

    @property
    def lookups(self) -> int:
        """Experts `fetch` has been asked for so far, resident or not (a counter; 0 where nothing loads)."""
        return 0

    @property
    @abstractmethod
    def bytes_moved(self) -> int:
        ...

    @abstractmethod
    def stats(self) -> dict:
        ...

    @abstractmethod
    def reset_stats(self) -> None:
        ...

    def close(self) -> None:
        """Release files, threads and buffers now (idempotent)."""


class DelegatingStore(ExpertStore):
    """An ExpertStore that forwards everything to `inner`; wrappers override what they change (the bench's
    timer overrides `fetch`)."""

    def __init__(self, inner: ExpertStore):
        self.inner = inner

    @property
    def forward_observers(self) -> list:
        return self.inner.forward_observers

    @property
    def forward_layer_hooks(self) -> list:
        return self.inner.forward_layer_hooks

    @property
    def device(self) -> torch.device:
        return self.inner.device

    @property
    def holds_all(self) -> bool:
        return self.inner.holds_all

    def fetch(self, layer: int, routing: Routing) -> Iterator[SlotGroup]:
        return self.inner.fetch(layer, routing)

    def slot_tensors(self, layer: int) -> tuple:
        return self.inner.slot_tensors(layer)

    def slot_index(self, layer: int, ids: list[int]) -> list[int]:
        return self.inner.slot_index(layer, ids)

    def pin(self, layer: int, ids: list[int]) -> None:
        self.inner.pin(layer, ids)

    def resident(self, layer: int) -> set[int]:
        return self.inner.resident(layer)

    def prefetch(self, layer: int, ids: list[int], keep: set[int] = frozenset()) -> int:
        return self.inner.prefetch(layer, ids, keep)

    def evict_all(self) -> None:
        self.inner.evict_all()

    @property
    def bytes_moved(self) -> int:
        return self.inner.bytes_moved

    @property
    def fetch_wait_s(self) -> float:
        return self.inner.fetch_wait_s

    @property
    def lookups(self) -> int:
        return self.inner.lookups

    def stats(self) -> dict:
        return self.inner.stats()

    def reset_stats(self) -> None:
        self.inner.reset_stats()

    def close(self) -> None:
        self.inner.close()


class ClosedStore(ExpertStore):
    """Takes a closed engine's store's place: any use raises InputError."""

    def __init__(self, what: str):
        self._what = what
        self.forward_observers, self.forward_layer_hooks = [], []

    def _closed(self):
        raise InputError(f"{self._what} is closed (close() was called); create a new LLM")

    @property
    def device(self) -> torch.device:
        self._closed()

    def fetch(self, layer: int, routing: Routing):
        self._closed()

    def slot_tensors(self, layer: int):
        self._closed()

    def slot_index(self, layer: int, ids: list[int]):
        self._closed()

    def pin(self, layer: int, ids: list[int]) -> None:
        self._closed()

    def resident(self, layer: int) -> set[int]:
        self._closed()

    @property
    def bytes_moved(self) -> int:
        self._closed()

    def stats(self) -> dict:
        self._closed()

    def reset_stats(self) -> None:
        self._closed()
