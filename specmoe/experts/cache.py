"""The device expert cache: bounded slots per MoE layer in front of a backing tier.

Each MoE layer owns one preallocated tensor [S, slot bytes] on the compute device; an
expert is one contiguous buffer [gate (I·D); up (I·D); down (D·I)], so a fetch is one
copy (or one aligned read straight into the slot). The forward computes over typed views of
those rows (gate_up [S, 2I, D], down [S, D, I]). `fetch(layer, routing)` hands out the resident
experts first, as one slot group, while misses load on a background I/O thread, so compute on
resident experts overlaps the transfers; then the loaded misses as a second group.

Which expert leaves a slot, and what stays after a forward, is the policy object's decision
(`policies.py`: ondemand, static, lru, lfu); the transfers run on the loader's I/O thread (`loader.py`).
A pinned set per layer (`pin`) is never evicted (SpecMoE's draft experts).

Prefetch (MoE-Overlap): while layer l computes, layer l+1's experts load in the background,
either `predicted` (layer l+1's router applied to layer l's MoE input) or `oracle` (the
exact union layer l+1 asked for in a previous identical run: record once, then replay; it
measures the best overlap possible on the same I/O channel with a perfect predictor).
"""
from __future__ import annotations

import time
from concurrent.futures import Future
from contextlib import contextmanager

import torch

from specmoe.config import ModelConfig
from specmoe.errors import InputError
from specmoe.experts.budget import SCRATCH_BUFFERS
from specmoe.experts.buffers import Spill, alloc_rows, slot_views
from specmoe.experts.loader import ExpertLoader
from specmoe.experts.oracle import OracleTrace
from specmoe.experts.policies import POLICIES, LayerSlots, make_policy
from specmoe.experts.store import ExpertStore
from specmoe.experts.tiers import slot_bytes
from specmoe.memory import check_fits, fmt_bytes, huge_backed_bytes, huge_pages_mode
from specmoe.models.moe import Routing, SlotGroup

# S=slots per layer, E=experts, N=tokens, K=top-k, D=hidden, I=expert hidden

PREFETCH = ("none", "oracle", "predicted")


class ExpertCache(ExpertStore):
    """An ExpertStore over a backing tier.

    Public API: `fetch(layer, routing)` (what the MoE block calls: models.moe.ExpertProvider), `slot_tensors(layer)`,
    `slot_index(layer, ids)`, `pin(layer, ids)`, `resident(layer)`, `stats()` / `reset_stats()`, `evict_all()`
    (cold cache), `set_static(hot)`,
    `attach_model(model)`, `observe` (a ForwardContext observer) and `layer_hook` (a ForwardContext
    layer hook, predicted prefetch) — the engine registers `forward_observers` / `forward_layer_hooks`
    on its ModelRunner — and `start_oracle_recording()` / `start_oracle_replay()`, `suspend_prefetch()`.
    Not thread-safe: one compute thread calls it; only the transfers run on the I/O thread."""

    def __init__(self, tier, cfg: ModelConfig, *, slots: int, policy: str = "adaptive", prefetch: str = "none",
                 device: torch.device | str = "cpu", memory_budget: int | None = None, link: dict | None = None,
                 scratch_buffers: int = SCRATCH_BUFFERS, memory_limit: dict | None = None):
        """`memory_limit`: what the memory limit the process runs under left for the experts (budget.LimitPlan's
        dict), shown in stats."""
        self.closed, self.loader = False, None
        self.memory_limit = memory_limit
        if policy not in POLICIES:
            raise InputError(f"cache_policy={policy!r}; choose one of {', '.join(POLICIES)}")
        if prefetch not in PREFETCH:
            raise InputError(f"prefetch={prefetch!r}; choose one of {', '.join(PREFETCH)}")
        if slots < cfg.top_k:
            raise InputError(f"the expert cache holds {slots} expert(s) per MoE layer, fewer than the {cfg.top_k} "
                             f"(top-k) a single token needs; raise cache_experts (or cache_bytes) to at least "
                             f"{cfg.top_k}")
        slots = min(slots, cfg.num_experts)
        self.tier, self.cfg, self.policy, self.prefetch_mode = tier, cfg, make_policy(policy), prefetch
        self.device = torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.dtype, self.numel = tier.dtype, cfg.expert_numel
        self.expert_bytes = tier.expert_bytes
        self.slot_bytes = slot_bytes(tier)
        self.slots = slots
        self.link = link
        self.memory_budget = memory_budget
        self.moe_layers = tuple(cfg.moe_layers)
        self.nbytes = slots * self.slot_bytes * len(self.moe_layers)
        # a union larger than a layer's slots streams through a few spare rows, allocated here, reused, never grown
        n_scratch = scratch_buffers if slots < cfg.num_experts else 0
        self.scratch_bytes = n_scratch * self.slot_bytes
        check_fits(f"the expert cache ({slots} slots × {len(self.moe_layers)} MoE layers × "
                   f"{fmt_bytes(self.slot_bytes)} + {n_scratch} scratch)", self.nbytes + self.scratch_bytes,
                   self.device, budget=memory_budget)
        self.layers: dict[int, LayerSlots] = {}
        # every layer's slots and the scratch rows in one block: on CPU one mapping, on huge pages (memory.py)
        block = alloc_rows(slots * len(self.moe_layers) + n_scratch, self.slot_bytes, self.device)
        for i, layer in enumerate(self.moe_layers):
            rows = block[i * slots: (i + 1) * slots]
            views = slot_views(tier.fmt, rows, self.expert_bytes, self.dtype, cfg)
            self.layers[layer] = LayerSlots(rows, cfg.num_experts, views)
        self._scratch: list[torch.Tensor] = list(block[len(self.moe_layers) * slots:])  # free spare rows
        self.scratch_buffers = n_scratch
        # host rows reads land in (slots, scratch, the tier's staging), and how many of their bytes sit on
        # transparent huge pages (read once here: the rows are faulted in when allocated)
        host = [block] if not self.cuda else []
        host += list(tier.host_buffers)
        self.host_rows_bytes = sum(t.numel() * t.element_size() for t in host)
        self.host_rows_huge_bytes = huge_backed_bytes(host)
        self.thp_mode = huge_pages_mode()
        self.loader = ExpertLoader(tier, self.device, self.slot_bytes)
        self.staging_bytes = self.loader.staging_bytes  # CUDA: pinned rows disk reads land in
        self.model = None
        self._next: tuple[int, list[int]] | None = None  # prefetch planned by the layer hook
        self._prefetch_on = True
        self.oracle = OracleTrace()
        if self.cuda:
            for L in self.layers.values():
                L.done_event = torch.cuda.Event()
                L.done_event.record(torch.cuda.current_stream(self.device))
            self._last_done = L.done_event
        self.reset_stats()
        self.forward_observers = [self.observe]
        self.forward_layer_hooks = [self.layer_hook] if prefetch == "predicted" else []

    def set_static(self, hot: dict[int, list[int]]) -> None:
        """Static policy: make each layer's hottest experts (most requested first) resident for good,
        leaving at least one slot on demand (counted under `static_bytes`)."""
        for layer, ids in hot.items():
            keep = list(ids)[: max(0, self.slots - 1 - len(self.layers[layer].pinned))]  # >= 1 slot on demand
            self._make_resident(self.layers[layer], layer, keep, "static")

    @property
    def static_experts(self) -> dict[int, list[int]]:
        return {layer: sorted(L.static) for layer, L in self.layers.items()}

    # ------------------------------------------------------------------ transfers
    def _submit(self, layer: int, e: int, dst: torch.Tensor, *, scratch: bool = False, after=None) -> Future:
        """Queue one expert load on the loader (handed to the I/O thread by `_flush`)."""
        if self.cuda and after is None:
            # a slot may be overwritten once the compute that last read this layer's slots is done;
            # a scratch buffer may have been read by any layer: wait for the latest compute
            after = self._last_done if scratch else self.layers[layer].done_event
        return self.loader.submit(layer, e, dst, after)

    def _flush(self) -> None:
        self.loader.flush()

    def _wait(self, fut: Future) -> None:
        try:
            self._s["fetch_wait_s"] += self.loader.wait(fut)
        except BaseException:
            self._forget(*fut.load)
            raise

    def _forget(self, layer: int, e: int, dst: torch.Tensor) -> None:
        """A load into `dst` failed (e.g. IntegrityError): whatever the slot holds is not expert e."""
        L = self.layers.get(layer)
        s = L.slot_of.get(e) if L is not None else None
        if s is not None and L.rows[s].data_ptr() == dst.data_ptr():
            self._release(L, e)
            for kept in (L.prefetched, L.pinned, L.static):
                kept.discard(e)

    def _await_layer(self, L: LayerSlots) -> None:
        while L.inflight:
            self._wait(L.inflight.pop())

    # ------------------------------------------------------------------ slots
    def _take_slot(self, L: LayerSlots, keep: set[int]) -> int | None:
        if L.free:
            return L.free.pop()
        v = self.policy.victim(L, keep)
        if v is None:
            return None
        if v in L.prefetched:
            L.prefetched.discard(v)
            self._s["prefetch_wasted"] += 1
        L.recency.pop(v)
        return L.slot_of.pop(v)

    def _place(self, L: LayerSlots, e: int, s: int) -> None:
        L.slot_of[e] = s
        L.recency[e] = None
        L.recency.move_to_end(e)

    def _release(self, L: LayerSlots, e: int) -> None:
        L.free.append(L.slot_of.pop(e))
        L.recency.pop(e, None)

    def _count_transfer(self, layer: int, n: int, kind: str | None = None) -> None:
        s = self._s
        s["fetches"] += n
        s["bytes_moved"] += n * self.tier.stored_bytes  # bytes read from the tier (its storage format)
        if kind:
            s[f"{kind}_bytes"] += n * self.tier.stored_bytes

    def _make_resident(self, L: LayerSlots, layer: int, ids: list[int], kind: str) -> None:
        """Load `ids` into slots synchronously and protect them as `kind` ('pin' or 'static')."""
        self._await_layer(L)
        if kind == "pin":
            L.pinned = set(ids)
        else:
            L.static = set(ids)
        keep = L.protected  # the *new* pinned/static sets: experts leaving them may be evicted now
        jobs = []
        for e in ids:
            if e in L.slot_of:
                L.prefetched.discard(e)
                continue
            s = self._take_slot(L, keep)
            assert s is not None, "validated: pinned + static experts fit in the slots"
            self._place(L, e, s)
            jobs.append(self._submit(layer, e, L.rows[s]))
        for f in jobs:
            self._wait(f)
        self._count_transfer(layer, len(jobs), kind)
        for e in self.policy.after_forward(L):  # ondemand/static: an expert no longer pinned is not kept either
            self._release(L, e)

    # ------------------------------------------------------------------ public API
    def attach_model(self, model) -> None:
        """Give the cache the model's routers (predicted prefetch applies layer l+1's router)."""
        self.model = model

    def pin(self, layer: int, ids: list[int]) -> None:
        """Replace `layer`'s pinned set with `ids`; they become resident now (fetched if needed, counted
        under `pin_bytes` and `bytes_moved`) and are never evicted until the next `pin` of the layer."""
        L = self._layer(layer)
        ids = sorted({int(e) for e in ids})
        bad = [e for e in ids if not 0 <= e < self.cfg.num_experts]
        if bad:
            raise InputError(f"cannot pin experts {bad} of layer {layer}: ids must be in [0, {self.cfg.num_experts})")
        if len(ids) + len(L.static - set(ids)) > self.slots:
            raise InputError(f"cannot pin {len(ids)} experts in layer {layer}: the cache has {self.slots} slots per "
                             f"layer ({len(L.static)} held by the static policy)")
        self._make_resident(L, layer, ids, "pin")

    def resident(self, layer: int) -> set[int]:
        """Expert ids whose weights sit in `layer`'s device slots now."""
        L = self._layer(layer)
        self._await_layer(L)
        return set(L.slot_of)

    @property
    def bytes_moved(self) -> int:
        return self._s["bytes_moved"]

    @property
    def fetch_wait_s(self) -> float:
        return self._s["fetch_wait_s"]

    @property
    def lookups(self) -> int:
        return self._s["hits"] + self._s["misses"]

    def prefetch(self, layer: int, ids: list[int], keep: set[int] = frozenset()) -> int:
        """Start loading the missing `ids` (most wanted first) into slots in the background; never evicts a
        pinned or static expert, one of `ids`, or one of `keep`, and never spills into scratch rows. Counted
        under `prefetch_bytes`; `prefetch_useful` / `prefetch_wasted` say later whether they were used."""
        if not self._prefetch_on:
            return 0
        L = self._layer(layer)
        protect = set(ids) | set(keep)
        n = 0
        for e in ids:
            if e in L.slot_of:
                continue
            slot = self._take_slot(L, protect)
            if slot is None:
                break
            self._place(L, e, slot)
            L.prefetched.add(e)
            L.inflight.append(self._submit(layer, e, L.rows[slot]))
            n += 1
        self._count_transfer(layer, n, "prefetch")
        self._flush()
        return n * self.tier.stored_bytes

    def observe(self, layer: int, routing: Routing) -> None:
        """ForwardContext observer: accumulate routed-assignment counts per expert (the host counts the fetch
        reads anyway)."""
        row = self._s["expert_counts"][self.moe_layers.index(layer)]
        for e, c in enumerate(routing.counts_host):
            row[e] += c

    def layer_hook(self, layer: int, x: torch.Tensor) -> None:
        """ForwardContext layer hook (predicted prefetch): route layer l's MoE input [N, D] with the next
        MoE layer's router; the union, most requested first, is fetched ahead while layer l computes."""
        nxt = self._next_layer(layer)
        if nxt is None or self.model is None or not self._prefetch_on:
            return
        mlp = self.model.layers[nxt].mlp
        _, _, ids = mlp.route(x)  # [N, K]
        counts = torch.bincount(ids.reshape(-1), minlength=self.cfg.num_experts)
        order = torch.argsort(counts, descending=True, stable=True)
        self._next = (nxt, [int(e) for e in order[: int((counts > 0).sum())].tolist()])

    def start_oracle_recording(self) -> None:
        """Oracle prefetch: forget any trace and record the runs from now on (warm-ups before this call
        are not part of the trace). A new cache records from construction."""
        self.oracle.start_recording()

    def start_oracle_replay(self) -> None:
        """Oracle prefetch: the runs so far were recorded; from now on replay them with the true next-layer
        union prefetched. The replayed run must be identical (same prompts, greedy). A layer whose union
        differs from the recording counts in `oracle_mismatches`; if the sequence of forwards itself
        diverges, the oracle stops prefetching."""
        self.oracle.start_replay()

    @contextmanager
    def suspend_prefetch(self):
        """No prefetch inside the block (e.g. while drafting with pinned experts only)."""
        prev, self._prefetch_on = self._prefetch_on, False
        try:
            yield
        finally:
            self._prefetch_on = prev

    def evict_all(self) -> None:
        """Drop every unprotected expert from the slots (cold cache, e.g. between benchmark runs)."""
        for L in self.layers.values():
            self._await_layer(L)
            for e in [e for e in L.slot_of if e not in L.protected]:
                self._release(L, e)
            L.prefetched.clear()

    def slot_tensors(self, layer: int) -> tuple:
        """The layer's slots as typed views gate_up [S, 2I, D], down [S, D, I], biases [S, 2I] / [S, D] or None
        (allocated once)."""
        return self._layer(layer).views

    def slot_index(self, layer: int, ids: list[int]) -> list[int]:
        """Slot of each of `ids`, which must be resident (e.g. pinned)."""
        L = self._layer(layer)
        self._await_layer(L)
        missing = [e for e in ids if e not in L.slot_of]
        if missing:
            raise InputError(f"experts {missing} of layer {layer} are not resident")
        return [L.slot_of[e] for e in ids]

    def _group(self, L: LayerSlots, experts: list[int], complete: bool, counts: list[int]) -> SlotGroup:
        """The layer's slots with a map of `experts` (others -> S); `counts`: the routing's host counts."""
        m = [self.slots] * (self.cfg.num_experts + 1)  # E: padding, no expert
        for e in experts:
            m[e] = L.slot_of[e]
        return SlotGroup.over(L.views, torch.tensor(m, device=self.device), complete, sum(counts[e] for e in experts))

    def _spill_group(self, e: int, row: torch.Tensor, counts: list[int]) -> SlotGroup:
        """A scratch row holding expert e as a one-slot group."""
        m = torch.ones(self.cfg.num_experts + 1, dtype=torch.long)
        m[e] = 0
        return SlotGroup.over(slot_views(self.tier.fmt, row[None], self.expert_bytes, self.dtype, self.cfg),
                              m.to(self.device), False, counts[e])

    def fetch(self, layer: int, routing: Routing):
        """Yield slot groups covering routing.needed: the resident experts first (computed while the misses
        load), then the misses as they arrive (each group: the next load and any later one already done, so
        compute overlaps the loads still running), then experts streamed through scratch rows one at a time."""
        L = self._layer(layer)
        ids = routing.needed
        s = self._s
        li = self.moe_layers.index(layer)
        self._await_layer(L)
        need = set(ids)
        if L.prefetched:
            s["prefetch_useful"] += len(L.prefetched & need)
            s["prefetch_wasted"] += len(L.prefetched - need)
            L.prefetched.clear()
        hits = [e for e in ids if e in L.slot_of]
        misses = [e for e in ids if e not in L.slot_of]
        jobs, later = [], []
        for e in misses:
            slot = self._take_slot(L, need)
            if slot is None:  # the union outgrew the layer's slots: through the scratch rows, never a failure
                later.append(e)
            else:
                self._place(L, e, slot)
                jobs.append((e, L.rows[slot], self._submit(layer, e, L.rows[slot])))
        s["scratch_fetches"] += len(later)
        spilled = Spill(self._scratch, later, lambda e, buf, after: self._submit(layer, e, buf, scratch=True,
                                                                                  after=after), self.device)
        self.policy.touch(L, ids)
        s["hits"] += len(hits)
        s["misses"] += len(misses)
        s["hits_per_layer"][li] += len(hits)
        s["misses_per_layer"][li] += len(misses)
        self._count_transfer(layer, len(misses))
        self._plan_next(layer, ids)  # queued behind this layer's misses on the I/O thread
        self._flush()
        done = set()
        try:
            if hits:
                t0 = time.perf_counter()
                yield self._group(L, hits, not misses, routing.counts_host)
                s["expert_compute_s"] += time.perf_counter() - t0
            waiting = list(jobs)
            while waiting:  # each group: the next load plus every later one already finished, computed while
                ready = []  # the rest load
                while waiting and (not ready or waiting[0][2].done()):
                    e, _, fut = waiting.pop(0)
                    self._wait(fut)
                    done.add(e)
                    ready.append(e)
                t0 = time.perf_counter()
                yield self._group(L, ready, not hits and not later and len(ready) == len(jobs), routing.counts_host)
                s["expert_compute_s"] += time.perf_counter() - t0
            while spilled:
                e, buf, fut = spilled.pop()
                self._wait(fut)
                t0 = time.perf_counter()
                yield self._spill_group(e, buf, routing.counts_host)
                s["expert_compute_s"] += time.perf_counter() - t0
                spilled.done(buf)  # the consumer is done with it: the next spilled expert may overwrite it
        finally:
            self._flush()
            for e, buf, fut in jobs:
                if e not in done:
                    fut.exception()  # never leave a transfer writing into a buffer we hand back
                    if e in L.slot_of and L.rows[L.slot_of[e]].data_ptr() == buf.data_ptr():
                        self._release(L, e)
            spilled.close()
            if self.cuda:  # fresh events: loads already queued keep waiting on the ones they captured
                L.done_event = torch.cuda.Event()
                L.done_event.record(torch.cuda.current_stream(self.device))
                self._last_done = L.done_event
            for e in self.policy.after_forward(L):
                self._release(L, e)

    # ------------------------------------------------------------------ prefetch
    def _next_layer(self, layer: int) -> int | None:
        i = self.moe_layers.index(layer)
        return self.moe_layers[i + 1] if i + 1 < len(self.moe_layers) else None

    def _plan_next(self, layer: int, ids: list[int]) -> None:
        target = None
        if self.prefetch_mode == "oracle":
            target, mismatch = self.oracle.step(layer, ids, self._next_layer(layer))
            self._s["oracle_mismatches"] += mismatch
        elif self.prefetch_mode == "predicted" and self._next is not None:
            target, self._next = self._next, None
        if target is None or target[0] == layer:
            return
        self.prefetch(*target)

    # ------------------------------------------------------------------ telemetry
    def _layer(self, layer: int) -> LayerSlots:
        if self.closed:
            raise InputError("the expert cache is closed (LLM.close() was called); create a new LLM")
        if layer not in self.layers:
            raise InputError(f"layer {layer} is not a MoE layer (MoE layers: {list(self.moe_layers)})")
        return self.layers[layer]

    def reset_stats(self) -> None:
        n, E = len(self.moe_layers), self.cfg.num_experts
        self.tier.reset_io_stats()
        self._s = {"bytes_moved": 0, "fetches": 0, "hits": 0, "misses": 0, "hits_per_layer": [0] * n,
                   "misses_per_layer": [0] * n, "fetch_wait_s": 0.0, "expert_compute_s": 0.0, "pin_bytes": 0,
                   "static_bytes": 0, "prefetch_bytes": 0, "prefetch_useful": 0, "prefetch_wasted": 0,
                   "scratch_fetches": 0, "oracle_mismatches": 0, "expert_counts": [[0] * E for _ in range(n)]}

    def stats(self) -> dict:
        s = self._s
        req = s["hits"] + s["misses"]
        out = {"offload": self.tier.kind, "cache_policy": self.policy.name, "prefetch": self.prefetch_mode,
               "cache_slots_per_layer": self.slots, "cache_bytes": self.nbytes, "bytes_per_expert": self.tier.stored_bytes,
               "expert_format": self.tier.fmt.name, "compute_bytes_per_expert": self.expert_bytes,
               "direct_io": self.tier.direct_io, "host_rows_bytes": self.host_rows_bytes,
               "host_rows_huge_bytes": self.host_rows_huge_bytes, "thp_mode": self.thp_mode,
               "emulated_link": self.link is not None, **(self.link or {}),
               **{k: (list(v) if isinstance(v, list) else v) for k, v in s.items()},
               "hit_rate": s["hits"] / req if req else 0.0,
               "hit_rate_per_layer": [h / (h + m) if h + m else 0.0
                                      for h, m in zip(s["hits_per_layer"], s["misses_per_layer"])],
               "scratch_buffers": self.scratch_buffers, "memory_limit": dict(self.memory_limit or {}) or None,
               **self.policy.stats([self.layers[i] for i in sorted(self.layers)])}
        out["expert_counts"] = [list(r) for r in s["expert_counts"]]
        if self.prefetch_mode == "oracle":
            out["oracle"] = "replaying" if self.oracle.replaying else "recording"
        if self.tier.kind == "disk":  # time in reads (I/O thread) and in checksum verification (compute thread)
            out.update(io_reads=self.tier.reads, io_read_s=self.tier.read_s, io_verify_s=self.tier.verify_s,
                       io_depth=self.loader.workers, io_max_inflight=self.tier.max_inflight)
        return out

    def close(self) -> None:
        """Stop the I/O thread, close the tier (its file; its host copies) and drop the slots, scratch and
        pinned staging buffers now. Idempotent; any later fetch/pin raises InputError."""
        if self.closed:
            return
        self.closed = True
        self.loader.close()
        self.tier.close()
        self.layers, self._scratch, self.oracle = {}, [], OracleTrace()
        if self.cuda:  # torch caches freed blocks: hand the (pinned) host and device memory back now
            torch.cuda.empty_cache()
            getattr(torch._C, "_host_emptyCache", lambda: None)()

    def __del__(self):
        if self.loader is not None:
            self.loader.close(wait=False)
