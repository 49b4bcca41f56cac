"""SpecMoE's draft model: the target's non-expert weights + `N` draft experts per MoE layer
(arXiv 2604.10152). No extra weights, no training, no copy of the model.

`DraftExperts` owns the draft set (N expert ids per MoE layer, pinned in the expert store)
and everything the draft forward needs as `ForwardContext` parts:

- `routing_hook` substitutes a routed non-draft expert: `affinity` (nearest draft expert
  by weight distance), `mask` (top-k among the draft experts by the router's own scores,
  renormalised per the family's rule), `random` (ablation);
- `draft_slots`: per MoE layer the store's slot tensors and a map draft expert → the slot it is
  pinned in; the draft computes through the same grouped op as the target (models.moe.routed_experts),
  over the tokens routed to each draft expert, reading the pinned slots in place (no copy, no host read);
- the draft never calls the provider, so drafting moves zero bytes by construction.

Draft-set policies: `hot-temporal` (top-N by activation count in the last verification
forward: the new set is pinned as that forward routes it, so a cache keeps the experts its own
fetch brought in; no extra traffic, no copy), `hot-global` (static, `<ckpt>/expert_profile.json`
or a profile of the prompts' prefill), `random` (static, seeded). A store that cannot pin N
experts per layer is an InputError.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch

from specmoe.config import ModelConfig
from specmoe.decoding.drafters.affinity import nearest_draft
from specmoe.errors import InputError
from specmoe.experts.store import ExpertStore
from specmoe.models.moe import ForwardContext, Routing, SlotGroup

# N=tokens, E=experts, K=top-k, Nd=draft experts per layer, D=hidden, I=expert hidden


def load_profile(path: Path, cfg: ModelConfig) -> dict[int, list[int]] | None:
    """`<checkpoint>/expert_profile.json` as {MoE layer: counts}, None when the checkpoint ships none
    (a malformed profile is an error, see `experts.profiling.load_profile`)."""
    from specmoe.experts.profiling import load_profile as read_counts
    f = path / "expert_profile.json"
    if not f.is_file():
        return None
    return dict(zip(cfg.moe_layers, read_counts(f, cfg)))


def top_n(counts: list[int] | list[float], n: int, prefer: set[int] = frozenset()) -> list[int]:
    """The n most-used experts; ties go to `prefer` (the current set, already resident), then to lower ids."""
    order = sorted(range(len(counts)), key=lambda e: (-counts[e], e not in prefer, e))
    return sorted(order[:n])


class DraftExperts:
    """The draft set and the draft's forward context parts (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, provider: ExpertStore, *, num_draft: int, policy: str, substitution: str,
                 seed: int, device: torch.device, affinity: dict[int, torch.Tensor] | None = None,
                 profile: dict[int, list[int]] | None = None, prefetch: bool = False):
        assert substitution != "affinity" or affinity is not None, "affinity substitution needs the affinity table"
        self.cfg, self.provider, self.device = cfg, provider, device
        self.n = min(num_draft, cfg.num_experts)
        self.policy, self.substitution = policy, substitution
        self.affinity = {layer: t.to(device) for layer, t in (affinity or {}).items()}
        self.profile = profile
        self.gen = torch.Generator(device=device)
        self.gen.manual_seed(seed)
        self.set_gen = torch.Generator().manual_seed(seed)  # random draft sets (host side)
        self.normalize = cfg.norm_topk_prob  # Mixtral's reader sets it: its router always renormalises
        self.ids: dict[int, list[int]] = {}
        self.ids_t: dict[int, torch.Tensor] = {}   # [Nd]
        self.local: dict[int, torch.Tensor] = {}   # [E] → index in the draft set (Nd for non-draft experts)
        self.sub: dict[int, torch.Tensor] = {}     # [E] → substitute draft expert (affinity)
        self.groups: dict[int, SlotGroup] = {}     # the store's slots with the map draft expert → its pinned slot
        self.last_counts: dict[int, list[int]] = {}
        self._deferred: dict[int, torch.Tensor] = {}  # layer → counts [E] on the device, not read yet
        self.prefill_counts: dict[int, list[int]] = {}
        self.verifying = False
        self.changed: dict[int, list[int]] = {}  # layer → its next draft set (pinned, indexed at end_target)
        self.hits = self.assignments = 0
        # draft-guided prefetch: experts the target's routers pick for drafted tokens, loaded while drafting
        self.prefetch = prefetch
        self.prefetch_bytes = 0
        self.prefetch_want: dict[int, set[int]] = {}  # this draft phase's picks per layer (kept, not evicted)
        self.refreshes = 0
        self.forwards = 0  # draft forwards run (one per drafted position per step)
        self.setup_bytes = self.refresh_bytes = 0
        self.refresh_s = 0.0  # seconds in end_target's refresh (step breakdown)
        # when a list: (layer, router top-k ids [N, K] before substitution) of every draft routing call, appended
        # in order (selfdraft's token trees record the target routers' picks per drafted node for EcoSpec)
        self.pick_log: list | None = None

    # ------------------------------------------------------------ draft set
    @property
    def ready(self) -> bool:
        return len(self.ids) == len(self.cfg.draft_layers)

    def _bytes(self) -> int:
        return self.provider.bytes_moved

    def _pin(self, layer: int, ids: list[int]) -> None:
        """Make the draft set resident in fixed slots of the store (the draft reads them in place). A store
        too small for N pinned experts raises InputError."""
        try:
            self.provider.pin(layer, sorted(ids))
        except InputError as e:
            raise InputError(f"draft_experts={self.n} cannot stay resident: {e}; lower draft_experts or raise "
                             "cache_experts / cache_bytes") from None

    def initial_ids(self, layer: int) -> list[int]:
        E = self.cfg.num_experts
        if self.policy == "random":
            return sorted(torch.randperm(E, generator=self.set_gen)[:self.n].tolist())
        if self.policy == "hot-global":
            counts = (self.profile or {}).get(layer) or self.prefill_counts.get(layer)
        else:
            counts = self.last_counts.get(layer)
        return top_n(counts or [0] * E, self.n)

    def setup(self) -> None:
        """Choose the first draft set and make it resident (pin). The bytes this moves are setup cost, outside
        every draft phase (`draft_setup_bytes`)."""
        self.resolve_counts()
        b0 = self._bytes()
        ids = {layer: self.initial_ids(layer) for layer in self.cfg.draft_layers}
        for layer, lids in ids.items():
            self.provider.pin(layer, [])  # drop a pinned set left by an earlier run: the cache may evict it for ours
            self._pin(layer, lids)
        for layer, lids in ids.items():
            self.assign(layer, lids)
        self.setup_bytes += self._bytes() - b0

    def repin(self) -> None:
        """Pin the current draft set again after the store's pins were dropped (a plain stretch of `auto` gave
        the slots back): experts evicted meanwhile are fetched again, and the slot maps follow the new slots."""
        for layer, ids in self.ids.items():
            self._pin(layer, ids)
            self.assign(layer, ids)

    def assign(self, layer: int, ids: list[int]) -> None:
        """Make `ids` (n distinct experts, resident in the store) the layer's draft set: routing maps and the
        map of each draft expert to the slot it is pinned in. Nothing is copied."""
        assert len(ids) == self.n, f"a draft set holds {self.n} experts, got {len(ids)}"
        E = self.cfg.num_experts
        self.ids[layer] = list(ids)
        self.ids_t[layer] = torch.tensor(ids, device=self.device)
        local = torch.full((E,), len(ids), dtype=torch.long, device=self.device)
        local[self.ids_t[layer]] = torch.arange(len(ids), device=self.device)
        self.local[layer] = local
        if self.substitution == "affinity":
            self.sub[layer] = nearest_draft(self.affinity[layer], self.ids_t[layer])
        slots = self.provider.slot_tensors(layer)
        slot_of = [slots[0].shape[0]] * (E + 1)  # non-draft experts and E (padding): outside the group
        for e, s in zip(ids, self.provider.slot_index(layer, ids)):
            slot_of[e] = s
        self.groups[layer] = SlotGroup.over(slots, torch.tensor(slot_of, device=self.device))

    # ------------------------------------------------------------ target forwards (counts, refresh)
    def observe(self, layer: int, routing: Routing) -> None:
        """ForwardContext observer, registered on the runner: sees every target forward (prefill,
        verification, AR steps of `auto`), never the draft's. Counts exclude padding. On a store that needs
        the union on the host anyway (a cache) the counts are used at once (the new draft set must be pinned
        before the layer's fetch); on a store that holds every expert they stay on the device until the
        forward ends (`end_target`: one host read for all layers)."""
        if self.provider.holds_all:
            self._deferred[layer] = routing.counts
            return
        self._counted(layer, routing.counts_host)

    def resolve_counts(self) -> None:
        """The deferred counts of the last target forward, read to the host at once."""
        if self._deferred:
            layers = list(self._deferred)
            rows = torch.stack([self._deferred[layer] for layer in layers]).tolist()
            self._deferred = {}
            for layer, counts in zip(layers, rows):
                self._counted(layer, counts)

    def _counted(self, layer: int, counts: list[int]) -> None:
        self.last_counts[layer] = counts
        if not self.verifying:
            acc = self.prefill_counts.setdefault(layer, [0] * len(counts))
            for e, c in enumerate(counts):
                acc[e] += c
            return
        if layer in self.ids:
            self.hits += sum(counts[e] for e in self.ids[layer])
            self.assignments += sum(counts)
        if self.policy == "hot-temporal" and layer in self.ids:
            cur = self.ids[layer]
            new = top_n(counts, self.n, set(cur))
            if set(new) != set(cur):
                # the staying experts keep their place; pin now, before this layer's fetch: the new draft experts
                # were routed in this forward, so a cache loads them once (as hits of the fetch that follows) and
                # keeps them; the draft reads them in place from the next draft phase on
                leaving = iter([i for i, e in enumerate(cur) if e not in new])
                ids = list(cur)
                for e in sorted(set(new) - set(cur)):
                    ids[next(leaving)] = e
                self.changed[layer] = ids
                self._pin(layer, new)

    def begin_target(self) -> None:
        self.resolve_counts()  # a prefill's deferred counts
        self.verifying = True
        self.changed = {}

    def end_target(self) -> None:
        """Finish the HotTemporal refresh: the arriving experts were pinned as the forward routed them, so only
        the small routing and slot maps change (no expert is copied)."""
        t0 = time.perf_counter()
        self.resolve_counts()
        self.verifying = False
        if not self.changed:
            self.refresh_s += time.perf_counter() - t0
            return
        b0 = self._bytes()
        for layer, ids in self.changed.items():
            self.assign(layer, ids)
        self.refreshes += 1
        self.refresh_bytes += self._bytes() - b0
        self.refresh_s += time.perf_counter() - t0
        self.changed = {}

    # ------------------------------------------------------------ draft forwards
    def context(self, observers: list | None = None) -> ForwardContext:
        """The draft's ForwardContext (one per draft phase): it computes from the pinned draft slots in place;
        its provider refuses to be used."""
        self.prefetch_want = {}
        return ForwardContext(provider=_NoProvider(), routing_hook=self.routing_hook, observers=list(observers or []),
                              layer_hooks=[], draft_slots=self.groups)

    def routing_hook(self, layer: int, logits: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
        """Map the router's top-k (weights [N, K] fp32, ids [N, K]) onto draft experts."""
        if self.pick_log is not None:
            self.pick_log.append((layer, ids))
        if self.prefetch:
            self._prefetch_picks(layer, ids)
        if self.substitution == "affinity":
            return weights, self.sub[layer][ids]
        draft = self.ids_t[layer]
        if self.substitution == "random":
            member = self.local[layer][ids] < len(draft)  # [N, K]
            pick = draft[torch.randint(len(draft), ids.shape, generator=self.gen, device=ids.device)]
            return weights, torch.where(member, ids, pick)
        # mask: re-route among draft experts with the router's own probabilities; with N < K only N
        # distinct experts exist, so take min(K, N) of them (never the same expert twice)
        probs = torch.softmax(logits.float(), dim=-1)[:, draft]  # [N, Nd]
        w, j = torch.topk(probs, min(ids.shape[1], len(draft)), dim=-1)
        if self.normalize:
            w = w / w.sum(dim=-1, keepdim=True)
        return w, draft[j]

    def _prefetch_picks(self, layer: int, ids: torch.Tensor) -> None:
        """Draft-guided prefetch: the router's own picks for the drafted tokens, before substitution, are
        what verification will most likely fetch; start loading the non-draft ones (most picked first)
        into free cache slots now, so the backing tier works while the draft computes."""
        outside = ids[self.local[layer][ids] == len(self.ids[layer])]  # picks that are not draft experts
        if outside.numel() == 0:
            return
        e, c = outside.unique(return_counts=True)
        want = e[c.argsort(descending=True, stable=True)].tolist()
        keep = self.prefetch_want.setdefault(layer, set())
        self.prefetch_bytes += self.provider.prefetch(layer, want, keep)
        keep.update(want)

    def stats(self) -> dict:
        return {"draft_set_hit_rate": self.hits / self.assignments if self.assignments else 0.0,
                "draft_prefetch": self.prefetch, "draft_prefetch_bytes": self.prefetch_bytes,
                "draft_set_refreshes": self.refreshes, "draft_forwards": self.forwards,
                "draft_setup_bytes": self.setup_bytes,
                "draft_refresh_bytes": self.refresh_bytes,
                "draft_set": {layer: sorted(ids) for layer, ids in self.ids.items()}}


class _NoProvider:
    """The draft's provider: the draft must never reach an expert tier."""

    def fetch(self, layer: int, routing):
        raise AssertionError(f"the draft tried to fetch experts of layer {layer}")
