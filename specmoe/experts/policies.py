"""Cache policies as objects, and the per-layer slot bookkeeping they decide over.

A policy answers three questions for the expert cache (`cache.py`), which owns the slots and the transfers:
which resident expert to evict when a slot is needed (`victim`), what a request does to the bookkeeping
(`touch`: hit/recency/frequency accounting), and which experts leave the slots once a layer's forward is done
(`after_forward`). Pinned (SpecMoE's draft set) and static experts are never a victim.

- `ondemand` (MoE-OnDemand): nothing outlives the layer's forward except pinned experts;
- `static` (MoE-Caching): the hottest experts of each layer from a profile stay (`ExpertCache.set_static`);
  the other slots behave on demand;
- `lru` / `lfu`: slots keep experts across forwards and evict the least recently / least frequently
  requested one (mixtral-offloading style);
- `adaptive`: per layer, LRU's or LFU's victim, whichever of the two would have hit more over the layer's
  recent requests. Both are simulated as ghost caches (expert ids only, the layer's evictable capacity) on the
  request stream; their hits decay by `Adaptive.DECAY` per forward. Which one wins depends on the workload
  (LFU keeps a skewed batch's hot experts, LRU follows a drifting one), so neither fixed rule is best
  everywhere.
- `s3fifo` (S3-FIFO, Yang et al., SOSP 2023): per layer, a small FIFO (~10% of the evictable slots) that new
  experts enter, a main FIFO with a 2-bit access count (a second chance per count), and a ghost FIFO of ids
  recently evicted from the small queue (as many as main holds). An expert leaving the small queue unrequested
  since it came is evicted (and remembered in the ghost); one requested again moves to main; an id found in
  the ghost goes straight to main. A one-time scan therefore passes through the small queue without evicting
  the re-used experts in main, which LRU cannot do.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict

import torch

# S=slots per layer, E=experts


class LayerSlots:
    """Slot bookkeeping of one MoE layer (touched only by the compute thread)."""

    def __init__(self, rows: torch.Tensor, num_experts: int, views: tuple):
        self.rows = rows  # [S, slot bytes] uint8
        self.views = views  # typed views of the rows: gate_up [S, 2I, D], down [S, D, I], biases or None
        self.slot_of: dict[int, int] = {}
        self.free = list(range(rows.shape[0]))[::-1]
        self.pinned: set[int] = set()
        self.static: set[int] = set()
        self.recency: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.freq = [0] * num_experts
        self.prefetched: set[int] = set()  # loaded ahead, not yet asked for
        self.inflight: list = []  # (future) loads into this layer's slots started by prefetch
        self.done_event = None  # CUDA: compute finished reading the slots
        self.ghosts: Ghosts | None = None  # the adaptive policy's simulated LRU and LFU caches
        self.fifo: S3Queues | None = None  # the s3fifo policy's queues

    @property
    def protected(self) -> set[int]:
        return self.pinned | self.static

    def evictable(self, keep: set[int]) -> list[int]:
        """Resident experts that may leave, least recently requested first."""
        return [e for e in self.recency if e not in keep and e not in self.pinned and e not in self.static]


class CachePolicy(ABC):
    name: str

    def victim(self, L: LayerSlots, keep: set[int]) -> int | None:
        """The expert to evict for a new one (never pinned, static or in `keep`); None: every slot is held."""
        cands = L.evictable(keep)
        return self.choose(L, cands) if cands else None

    @abstractmethod
    def choose(self, L: LayerSlots, candidates: list[int]) -> int:
        """Pick among evictable `candidates` (least recently requested first)."""

    def touch(self, L: LayerSlots, ids: list[int]) -> None:
        """A forward requested `ids` of the layer: count them and mark them most recently used."""
        for e in ids:
            L.freq[e] += 1
            if e in L.recency:
                L.recency.move_to_end(e)

    def after_forward(self, L: LayerSlots) -> list[int]:
        """Experts to drop from the slots once the layer's forward (or a pin) is done; none by default."""
        return []

    def stats(self, layers: list[LayerSlots]) -> dict:
        """What the policy decided, for the cache's stats (none by default)."""
        return {}


class LRU(CachePolicy):
    name = "lru"

    def choose(self, L: LayerSlots, candidates: list[int]) -> int:
        return candidates[0]


class LFU(CachePolicy):
    name = "lfu"

    def choose(self, L: LayerSlots, candidates: list[int]) -> int:
        order = {e: i for i, e in enumerate(L.recency)}
        return min(candidates, key=lambda e: (L.freq[e], order[e]))  # ties: least recently used


class OnDemand(CachePolicy):
    """Nothing outlives the forward but protected experts and prefetched ones not yet asked for (the only
    evictable kind between forwards, evicted least recently used first)."""
    name = "ondemand"

    def choose(self, L: LayerSlots, candidates: list[int]) -> int:
        return candidates[0]

    def after_forward(self, L: LayerSlots) -> list[int]:
        return [e for e in L.slot_of if e not in L.protected and e not in L.prefetched]


class Static(OnDemand):
    """On demand around a static set (the profile's hottest experts, set by `ExpertCache.set_static`)."""
    name = "static"


class Ghosts:
    """Simulated LRU and LFU caches of one layer (expert ids only) and their decayed hit counts."""

    def __init__(self):
        self.lru: OrderedDict[int, None] = OrderedDict()  # oldest first
        self.lfu: OrderedDict[int, None] = OrderedDict()  # resident in the simulated LFU cache, oldest first
        self.score = {"lru": 0.0, "lfu": 0.0}
        self.hits = {"lru": 0, "lfu": 0}
        self.requests = 0

    def feed(self, ids: list[int], freq: list[int], capacity: int, decay: float) -> None:
        """One forward requested `ids` (freq: the counts after this request)."""
        keep = set(ids)
        for name, ghost in (("lru", self.lru), ("lfu", self.lfu)):
            hit = sum(e in ghost for e in ids)
            self.hits[name] += hit
            self.score[name] = self.score[name] * decay + hit
            for e in ids:
                if e in ghost:
                    ghost.move_to_end(e)
                else:
                    ghost[e] = None
            over = len(ghost) - capacity
            if over > 0:  # evict as the real rule would: never this forward's experts while others remain
                old = [e for e in ghost if e not in keep]  # oldest first
                if name == "lfu":
                    order = {e: i for i, e in enumerate(old)}
                    old.sort(key=lambda e: (freq[e], order[e]))
                gone = old[:over] + [e for e in ghost if e in keep][:max(0, over - len(old))]
                for e in gone:
                    del ghost[e]
        self.requests += len(ids)

    @property
    def rule(self) -> str:
        return "lfu" if self.score["lfu"] > self.score["lru"] else "lru"


class Adaptive(CachePolicy):
    """LRU's or LFU's victim per layer, whichever a ghost simulation of each hit more recently (module
    docstring)."""
    name = "adaptive"
    DECAY = 0.97  # per forward of the layer: the comparison spans roughly the last 30 forwards

    def __init__(self):
        self.rules = {"lru": LRU(), "lfu": LFU()}

    def choose(self, L: LayerSlots, candidates: list[int]) -> int:
        rule = L.ghosts.rule if L.ghosts is not None else "lru"
        return self.rules[rule].choose(L, candidates)

    def touch(self, L: LayerSlots, ids: list[int]) -> None:
        super().touch(L, ids)
        if L.ghosts is None:
            L.ghosts = Ghosts()
        L.ghosts.feed(ids, L.freq, max(L.rows.shape[0] - len(L.protected), 1), self.DECAY)

    def stats(self, layers: list[LayerSlots]) -> dict:
        ghosts = [L.ghosts for L in layers if L.ghosts is not None]
        req = sum(g.requests for g in ghosts)
        return {"adaptive_rule_per_layer": [L.ghosts.rule if L.ghosts is not None else "lru" for L in layers],
                "adaptive_ghost_hit_rate": {r: sum(g.hits[r] for g in ghosts) / req if req else 0.0
                                            for r in ("lru", "lfu")}}


class S3Queues:
    """One layer's S3-FIFO state: expert ids only (the slots are the cache's). `small` and `main`: resident,
    unprotected experts, oldest first, each with an access count 0..3 (`count`); `ghost`: ids evicted from
    `small` unrequested, oldest first."""

    def __init__(self):
        self.small: OrderedDict[int, None] = OrderedDict()
        self.main: OrderedDict[int, None] = OrderedDict()
        self.ghost: OrderedDict[int, None] = OrderedDict()
        self.count: dict[int, int] = {}
        self.n = dict.fromkeys(("ghost_hits", "promotions", "small_evictions", "main_evictions"), 0)

    def forget_gone(self, L: LayerSlots) -> None:
        """Forget experts that left the slots or became protected outside the policy (a failed load,
        `evict_all`, a pin)."""
        for q in (self.small, self.main):
            for e in [e for e in q if e not in L.slot_of or e in L.pinned or e in L.static]:
                del q[e]
                self.count.pop(e, None)

    def add_unseen(self, L: LayerSlots, skip: set[int] = frozenset()) -> None:
        """Queue resident experts the policy has not seen yet (placed for a request, or prefetched) as new."""
        for e in L.recency:
            if e not in self.count and e not in L.pinned and e not in L.static and e not in skip:
                self.insert(e)

    def insert(self, e: int) -> None:
        if e in self.ghost:  # evicted from small not long ago and asked for again: re-used, straight to main
            del self.ghost[e]
            self.main[e] = None
            self.n["ghost_hits"] += 1
        else:
            self.small[e] = None
        self.count[e] = 0

    def evict(self, candidates: set[int], capacity: int) -> int:
        """Remove and return one of `candidates` (resident, evictable; at least one), moving others between the
        queues as S3-FIFO does. Experts outside `candidates` (this forward's) count as requested now: one at the
        head of small moves to main, one at the head of main goes round again without losing a count."""
        small_target = max(1, round(S3FIFO.SMALL_SHARE * capacity))
        in_small = sum(e in candidates for e in self.small)
        in_main = sum(e in candidates for e in self.main)
        while True:  # ends: each pass evicts, moves an expert small -> main, or takes a count from a main candidate
            if in_small and (len(self.small) >= small_target or not in_main):
                e = next(iter(self.small))
                del self.small[e]
                if e in candidates:
                    if self.count[e] == 0:
                        del self.count[e]
                        self.ghost[e] = None
                        while len(self.ghost) > max(1, capacity - small_target):
                            self.ghost.popitem(last=False)
                        self.n["small_evictions"] += 1
                        return e
                    in_small, in_main = in_small - 1, in_main + 1
                self.main[e] = None  # requested since it came (or being requested now): re-used
                self.n["promotions"] += 1
                continue
            e = next(iter(self.main))
            self.main.move_to_end(e)
            if e not in candidates:
                continue
            if self.count[e] > 0:
                self.count[e] -= 1  # second chance
                continue
            del self.main[e], self.count[e]
            self.n["main_evictions"] += 1
            return e


class S3FIFO(CachePolicy):
    """S3-FIFO per layer (module docstring): small FIFO, main FIFO with a 2-bit access count, ghost FIFO."""
    name = "s3fifo"
    SMALL_SHARE = 0.10  # of the layer's evictable slots
    MAX_COUNT = 3  # 2 bits

    @staticmethod
    def _queues(L: LayerSlots) -> S3Queues:
        if L.fifo is None:
            L.fifo = S3Queues()
        L.fifo.forget_gone(L)
        return L.fifo

    @staticmethod
    def capacity(L: LayerSlots) -> int:
        return max(L.rows.shape[0] - len(L.protected), 1)

    def choose(self, L: LayerSlots, candidates: list[int]) -> int:
        q, cands = self._queues(L), set(candidates)
        q.add_unseen(L, skip=set(L.recency) - cands)  # this forward's experts are queued by `touch`, after it
        return q.evict(cands, self.capacity(L))

    def touch(self, L: LayerSlots, ids: list[int]) -> None:
        super().touch(L, ids)
        q = self._queues(L)
        for e in ids:
            if e in q.count:  # asked for again since it came
                q.count[e] = min(q.count[e] + 1, self.MAX_COUNT)
        q.add_unseen(L)  # this forward's misses (just placed) come in unrequested-since: count 0

    def stats(self, layers: list[LayerSlots]) -> dict:
        qs = [L.fifo for L in layers if L.fifo is not None]
        return {f"s3fifo_{k}": sum(q.n[k] for q in qs) for k in ("ghost_hits", "promotions", "small_evictions",
                                                                  "main_evictions")}


POLICY_CLASSES: dict[str, type[CachePolicy]] = {p.name: p for p in (OnDemand, Static, LRU, LFU, Adaptive, S3FIFO)}
POLICIES = tuple(POLICY_CLASSES)


def make_policy(name: str) -> CachePolicy:
    return POLICY_CLASSES[name]()
