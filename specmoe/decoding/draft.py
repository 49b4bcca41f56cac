"""SpecMoE's draft model: the target's non-expert weights + `N` draft experts per MoE layer
(arXiv 2604.10152). No extra weights, no training, no copy of the model.

`DraftExperts` owns the draft set (N expert ids per MoE layer, plus a private copy of
their packed weights stacked for one grouped op) and everything the draft forward
needs as `ForwardContext` parts:

- `routing_hook` substitutes a routed non-draft expert: `affinity` (nearest draft expert
  by weight distance), `mask` (top-k among the draft experts by the router's own scores,
  renormalised per the family's rule), `random` (ablation);
- `experts_override` computes the N draft experts as two GEMMs, without the provider and
  without a host sync per layer;
- the draft never calls the provider, so drafting moves zero bytes by construction.

Draft-set policies: `hot-temporal` (top-N by activation count in the last verification
forward: those experts streamed by in that forward, so the new set is copied from the
fetch stream, no extra traffic), `hot-global` (static, `<ckpt>/expert_profile.json` or a
profile of the prompts' prefill), `random` (static, seeded). The provider is asked to
`pin` the draft set when it can, so a bounded expert cache keeps it resident.
"""
from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.nn.functional as F

from specmoe.config import ModelConfig
from specmoe.decoding.affinity import nearest_draft
from specmoe.decoding.breakdown import now
from specmoe.errors import InputError
from specmoe.experts.store import DelegatingStore, ExpertStore
from specmoe.models.moe import ForwardContext, expert_views, glu, grouped_experts, swiglu

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


class _CapturingProvider(DelegatingStore):
    """Wraps the provider during a target forward and copies each expert joining the next draft set
    into the draft's stacks as it streams by (HotTemporal refresh without extra fetches)."""

    def __init__(self, inner: ExpertStore, owner: "DraftExperts"):
        super().__init__(inner)
        self.owner = owner

    def fetch(self, layer: int, ids: list[int]):
        want = self.owner.arriving.get(layer, {})
        for e, buf in self.inner.fetch(layer, ids):
            if e in want:
                self.owner.write_row(layer, want[e], buf)
                self.owner.captured.add((layer, e))
            yield e, buf


class DraftExperts:
    """The draft set and the draft's forward context parts (see the module docstring)."""

    def __init__(self, cfg: ModelConfig, provider, *, num_draft: int, policy: str, substitution: str, seed: int,
                 device: torch.device, affinity: dict[int, torch.Tensor] | None = None,
                 profile: dict[int, list[int]] | None = None, prefetch: bool = False,
                 calibration: dict | None = None):
        assert substitution != "affinity" or affinity is not None, "affinity substitution needs the affinity table"
        self.cfg, self.provider, self.device = cfg, provider, device
        self.n = min(num_draft, cfg.num_experts)
        self.policy, self.substitution = policy, substitution
        self.affinity = {layer: t.to(device) for layer, t in (affinity or {}).items()}
        self.profile = profile
        self.gen = torch.Generator(device=device)
        self.gen.manual_seed(seed)
        self.set_gen = torch.Generator().manual_seed(seed)  # random draft sets (host side)
        self.normalize = cfg.model_type == "mixtral" or cfg.norm_topk_prob
        self.ids: dict[int, list[int]] = {}
        self.ids_t: dict[int, torch.Tensor] = {}   # [Nd]
        self.local: dict[int, torch.Tensor] = {}   # [E] → index in the draft set (Nd for non-draft experts)
        self.sub: dict[int, torch.Tensor] = {}     # [E] → substitute draft expert (affinity)
        self.w1: dict[int, torch.Tensor] = {}      # [Nd, 2I, D] gate and up of the draft experts
        self.w2cat: dict[int, torch.Tensor] = {}   # [D, Nd·I] down, concatenated for one GEMM
        self.b1: dict[int, torch.Tensor] = {}      # [Nd, 2I] gate/up biases (families with expert biases)
        self.b2: dict[int, torch.Tensor] = {}      # [Nd, D] down biases
        self.last_counts: dict[int, list[int]] = {}
        self.prefill_counts: dict[int, list[int]] = {}
        self.verifying = False
        self.arriving: dict[int, dict[int, int]] = {}  # layer → {expert joining the set: stack row it takes}
        self.captured: set[tuple[int, int]] = set()     # (layer, expert) already copied into its row
        self.hits = self.assignments = 0
        # draft-guided prefetch: experts the target's routers pick for drafted tokens, loaded while drafting
        self.prefetch = prefetch
        self.prefetch_bytes = 0
        self.prefetch_want: dict[int, set[int]] = {}  # this draft phase's picks per layer (kept, not evicted)
        self.refreshes = 0
        self.setup_bytes = self.refresh_bytes = 0
        self.refresh_s = 0.0  # seconds in end_target's refresh (step breakdown)
        self.sparse_from: int | None = None  # token count from which the grouped form runs (see calibrate)
        # token count -> {form: seconds}, plus "grouped_from"; shared by the drafters of one engine
        self.calibration: dict = {} if calibration is None else calibration
        self.pin_refused: set[int] = set()
        self.pinned: dict[int, set[int]] = {}  # what the provider was last asked to pin

    # ------------------------------------------------------------ draft set
    @property
    def ready(self) -> bool:
        return len(self.ids) == len(self.cfg.moe_layers)

    def _bytes(self) -> int:
        return self.provider.bytes_moved

    def _pin(self, layer: int, ids: list[int]) -> None:
        """Ask the provider to keep the draft set resident. A cache too small for N pinned experts refuses
        (InputError); the draft still works from its own copy, and `draft_pin_refused` says so."""
        pin = self.provider.pin
        prev, new = self.pinned.get(layer, set()), set(ids)
        try:
            if prev - new:  # unpin the leaving experts first, so the cache may evict them for the arriving ones
                pin(layer, sorted(prev & new))
                self.pinned[layer] = prev & new
            pin(layer, sorted(new))
            self.pinned[layer] = new
        except InputError:
            self.pin_refused.add(layer)
        else:
            self.pin_refused.discard(layer)

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
        """Choose the first draft set, make it resident (pin) and copy it into the draft's stacks. The
        bytes this moves are setup cost, outside every draft phase (`draft_setup_bytes`)."""
        b0 = self._bytes()
        ids = {layer: self.initial_ids(layer) for layer in self.cfg.moe_layers}
        for layer, lids in ids.items():
            self.provider.pin(layer, [])  # drop a pinned set left by an earlier run: the cache may evict it for ours
            self._pin(layer, lids)
        for layer, lids in ids.items():
            self.assign(layer, lids)
        self.setup_bytes += self._bytes() - b0
        self.calibrate()

    def assign(self, layer: int, ids: list[int]) -> None:
        """Make `ids` (n distinct experts) the layer's draft set, expert ids[i] in stack row i, copying each
        from the provider into the stacks (allocated on first use, in the dtype the provider computes in)."""
        cfg = self.cfg
        D, I, Nd = cfg.hidden_size, cfg.expert_intermediate_size, self.n
        assert len(ids) == Nd, f"a draft set holds {Nd} experts, got {len(ids)}"
        row = {e: i for i, e in enumerate(ids)}
        for e, buf in self.provider.fetch(layer, sorted(ids)):
            if layer not in self.w1:
                self.w1[layer] = torch.empty(Nd, 2 * I, D, dtype=buf.dtype, device=self.device)
                self.w2cat[layer] = torch.empty(D, Nd * I, dtype=buf.dtype, device=self.device)
                if cfg.expert_bias:
                    self.b1[layer] = torch.empty(Nd, 2 * I, dtype=buf.dtype, device=self.device)
                    self.b2[layer] = torch.empty(Nd, D, dtype=buf.dtype, device=self.device)
            self.write_row(layer, row[e], buf)
        self._index(layer, ids)

    @property
    def nbytes(self) -> int:
        """Bytes of the draft's private copy of its experts (the stacks, allocated once per layer)."""
        return sum(t.numel() * t.element_size() for d in (self.w1, self.w2cat, self.b1, self.b2) for t in d.values())

    def write_row(self, layer: int, i: int, buf: torch.Tensor) -> None:
        """Copy a packed expert buffer [gate; up; down] into row i of the draft's stacks (in place: the
        stacks are allocated once, a refresh copies only the experts that join the set)."""
        I = self.cfg.expert_intermediate_size
        gate_up, down, gate_up_bias, down_bias = expert_views(buf, self.cfg)
        self.w1[layer][i].copy_(gate_up)
        self.w2cat[layer][:, i * I:(i + 1) * I].copy_(down)
        if self.cfg.expert_bias:
            self.b1[layer][i].copy_(gate_up_bias)
            self.b2[layer][i].copy_(down_bias)

    def _index(self, layer: int, ids: list[int]) -> None:
        """Routing maps of a draft set whose expert ids[i] sits in stack row i."""
        E, Nd = self.cfg.num_experts, len(ids)
        self.ids[layer] = list(ids)
        self.ids_t[layer] = torch.tensor(ids, device=self.device)
        local = torch.full((E,), Nd, dtype=torch.long, device=self.device)
        local[self.ids_t[layer]] = torch.arange(Nd, device=self.device)
        self.local[layer] = local
        if self.substitution == "affinity":
            self.sub[layer] = nearest_draft(self.affinity[layer], self.ids_t[layer])

    # ------------------------------------------------------------ target forwards (counts, refresh)
    def observe(self, layer: int, ids: torch.Tensor, counts: list[int]) -> None:
        """ForwardContext observer, registered on the runner: sees every target forward (prefill,
        verification, AR steps of `auto`). Draft forwards bypass it (they use `experts_override`).
        Padding rows of ragged forwards never reach it: the MoE block routes real tokens only."""
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
            arriving = sorted(set(new) - set(cur))
            if arriving:
                # each arriving expert takes the stack row of a leaving one; it is copied there as this layer's
                # fetch streams it by (`_CapturingProvider`)
                rows = [i for i, e in enumerate(cur) if e not in new]
                self.arriving[layer] = dict(zip(arriving, rows))
                # pin now, before this layer's fetch: the new draft experts were routed in this forward, so a
                # cache loads them once (as hits of the fetch that follows) instead of fetching and re-pinning
                self._pin(layer, new)

    def target_context(self, ctx: ForwardContext) -> ForwardContext:
        """Turn the runner's context of a target forward into one that also captures the next draft set."""
        if self.policy == "hot-temporal" and self.ready:
            ctx.provider = _CapturingProvider(ctx.provider, self)
        return ctx

    def begin_target(self) -> None:
        self.verifying = True
        self.arriving, self.captured = {}, set()

    def end_target(self) -> None:
        """Finish the HotTemporal refresh: the arriving experts sit in their rows (copied from the fetch
        stream), so only the small routing maps change."""
        self.verifying = False
        if not self.arriving:
            return
        t0 = time.perf_counter()
        b0 = self._bytes()
        for layer, rows in self.arriving.items():
            missing = [e for e in rows if (layer, e) not in self.captured]
            if missing:  # not expected: every arriving expert was routed, hence fetched, in this forward
                for e, buf in self.provider.fetch(layer, missing):
                    self.write_row(layer, rows[e], buf)
            ids = list(self.ids[layer])
            for e, i in rows.items():
                ids[i] = e
            self._index(layer, ids)
        self.refreshes += 1
        self.refresh_bytes += self._bytes() - b0
        self.refresh_s += time.perf_counter() - t0
        self.arriving, self.captured = {}, set()

    # ------------------------------------------------------------ draft forwards
    def context(self, observers: list | None = None) -> ForwardContext:
        """The draft's ForwardContext (one per draft phase). Its provider refuses to be used: the draft
        computes only from its own stacks."""
        self.prefetch_want = {}
        return ForwardContext(provider=_NoProvider(), routing_hook=self.routing_hook, observers=list(observers or []),
                              layer_hooks=[], experts_override=self.experts_override)

    def routing_hook(self, layer: int, logits: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
        """Map the router's top-k (weights [N, K] fp32, ids [N, K]) onto draft experts."""
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

    def experts_override(self, layer: int, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The draft's routed-expert output for x [N, D] with every id in the draft set → [N, D], in the form
        measured faster at this token count (`calibrate`): the grouped form of the target (each used draft
        expert once over its tokens: K/Nd of the FLOPs and only the used experts' bytes) or dense over all
        Nd draft experts as two GEMMs (no host read, fewest ops: wins for small experts and few tokens)."""
        loc = self.local[layer][ids]  # [N, K] in [0, Nd)
        if self.sparse_from is not None and ids.shape[0] >= self.sparse_from:
            return self._grouped(layer, x, weights, loc)
        return self._dense(layer, x, weights, loc)

    def _grouped(self, layer: int, x: torch.Tensor, weights: torch.Tensor, loc: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        I, bias = cfg.expert_intermediate_size, cfg.expert_bias

        def run(needed, xs):
            for i, j in enumerate(needed):  # j: row of the draft's stacks
                yield i, swiglu(xs[i], self.w1[layer][j], self.w2cat[layer][:, j * I:(j + 1) * I],
                                self.b1[layer][j] if bias else None, self.b2[layer][j] if bias else None,
                                cfg.swiglu_limit, cfg.swiglu_alpha)
        return grouped_experts(x, weights, loc, len(self.ids[layer]), run)

    def _dense(self, layer: int, x: torch.Tensor, weights: torch.Tensor, loc: torch.Tensor) -> torch.Tensor:
        N, Nd = loc.shape[0], len(self.ids[layer])
        dense = torch.zeros(N, Nd + 1, dtype=x.dtype, device=x.device).scatter_add_(
            1, loc, weights.to(x.dtype))[:, :Nd]  # [N, Nd] routing weight of each draft expert
        cfg = self.cfg
        h = F.linear(x, self.w1[layer].view(-1, x.shape[1]),
                     self.b1[layer].view(-1) if cfg.expert_bias else None).view(N, Nd, -1)  # [N, Nd, 2I]
        g, u = h.chunk(2, dim=-1)
        a = glu(g, u, cfg.swiglu_limit, cfg.swiglu_alpha) * dense[..., None]  # [N, Nd, I]
        out = F.linear(a.reshape(N, -1), self.w2cat[layer])  # [N, D]
        return out + dense @ self.b2[layer] if cfg.expert_bias else out

    @torch.inference_mode()
    def calibrate(self, token_counts=(1, 8, 64), repeats: int = 2) -> None:
        """Time both forms on this machine for the first MoE layer's stacks (random tokens routed uniformly
        over the draft set) and use the grouped form from the smallest token count at which it wins at that
        count and every larger one measured (`draft_grouped_from`, None: always dense)."""
        if "grouped_from" in self.calibration:  # measured by an earlier run of this engine
            self.sparse_from = self.calibration["grouped_from"]
            return
        layer = self.cfg.moe_layers[0]
        Nd, K, D = len(self.ids[layer]), min(self.cfg.top_k, len(self.ids[layer])), self.cfg.hidden_size
        g = torch.Generator(device=self.device).manual_seed(0)
        wins = []
        for N in token_counts:
            x = torch.randn(N, D, generator=g, device=self.device, dtype=self.w1[layer].dtype)
            loc = torch.rand(N, Nd, generator=g, device=self.device).argsort(-1)[:, :K]  # K distinct per token
            w = torch.rand(N, K, generator=g, device=self.device)
            best = {}
            for name, f in (("dense", self._dense), ("grouped", self._grouped)):
                f(layer, x, w, loc)  # warm-up
                t = []
                for _ in range(repeats):
                    t0 = now(self.device)
                    f(layer, x, w, loc)
                    t.append(now(self.device) - t0)
                best[name] = min(t)
            wins.append(best["grouped"] < best["dense"])
            self.calibration[N] = best
        self.sparse_from = None
        for i in range(len(token_counts) - 1, -1, -1):
            if not wins[i]:
                break
            self.sparse_from = token_counts[i]
        self.calibration["grouped_from"] = self.sparse_from

    def stats(self) -> dict:
        return {"draft_set_hit_rate": self.hits / self.assignments if self.assignments else 0.0,
                "draft_prefetch": self.prefetch, "draft_prefetch_bytes": self.prefetch_bytes,
                "draft_grouped_from": self.sparse_from,
                "draft_set_refreshes": self.refreshes, "draft_setup_bytes": self.setup_bytes,
                "draft_refresh_bytes": self.refresh_bytes, "draft_pin_refused": sorted(self.pin_refused),
                "draft_copy_bytes": self.nbytes,
                "draft_set": {layer: sorted(ids) for layer, ids in self.ids.items()}}


class _NoProvider:
    """The draft's provider: the draft must never reach an expert tier."""

    def fetch(self, layer: int, ids: list[int]):
        raise AssertionError(f"the draft tried to fetch experts {ids} of layer {layer}")
