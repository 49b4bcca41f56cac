"""SpecMoE end to end: greedy output equals plain greedy decoding token for token, seeded sampled
runs repeat, drafting moves zero bytes, and the step's bookkeeping (τ, acceptance, fallback)."""
from __future__ import annotations

import random

import pytest

from specmoe import LLM, SamplingParams
from specmoe.experts.store import ExpertStore

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")

# (family, N, γ, substitution, policy): every family, substitution and policy, N < k, N = k, N > k
CONFIGS = [
    ("mixtral", 4, 4, "affinity", "hot-temporal"),
    ("mixtral", 1, 3, "mask", "hot-global"),
    ("qwen2_moe", 2, 5, "mask", "hot-temporal"),
    ("qwen2_moe", 3, 2, "random", "random"),
    ("qwen3_moe", 1, 4, "affinity", "random"),
    ("qwen3_moe", 6, 6, "random", "hot-temporal"),
    ("olmoe", 2, 1, "affinity", "hot-global"),
    ("olmoe", 8, 4, "mask", "hot-temporal"),
]


def prompts(n: int, seed: int, max_len: int = 14) -> list[list[int]]:
    r = random.Random(seed)
    return [[r.randrange(96) for _ in range(r.randint(1, max_len))] for _ in range(n)]


BATCHES = {  # name: (prompts, params): batch 1, 7 ragged (prompts and max_tokens), 64 short
    "b1": (prompts(1, 1), SamplingParams(max_tokens=24)),
    "b7": (prompts(7, 7), [SamplingParams(max_tokens=m) for m in (1, 2, 5, 9, 13, 16, 20)]),
    "b64": (prompts(64, 64), SamplingParams(max_tokens=6)),
}

_ref: dict = {}


def reference(path, batch):
    """Plain greedy (decoding='ar') outputs, computed once per (checkpoint, batch)."""
    key = (str(path), batch)
    if key not in _ref:
        ps, sp = BATCHES[batch]
        _ref[key] = [o.token_ids for o in LLM(path, decoding="ar").generate(ps, sp)]
    return _ref[key]


class CountingProvider(ExpertStore):
    """Stands in for an expert cache: pinned experts are resident, every other fetch counts its bytes."""

    def __init__(self, inner):
        self.inner = inner
        self.forward_observers, self.forward_layer_hooks = inner.forward_observers, inner.forward_layer_hooks
        self.pinned: dict[int, set[int]] = {}
        self.bytes_moved = self.fetches = self.pins = 0
        gate_up, down, _, _ = inner.slot_tensors(inner.moe_layers[0])
        self.expert_bytes = (gate_up[0].numel() + down[0].numel()) * gate_up.element_size()

    def pin(self, layer: int, ids: list[int]) -> None:
        self.pinned[layer] = set(ids)
        self.pins += 1

    def resident(self, layer: int) -> set[int]:
        return set(self.pinned.get(layer, ()))

    def fetch(self, layer, routing):
        for e in routing.needed:
            self.fetches += 1
            if e not in self.pinned.get(layer, ()):
                self.bytes_moved += self.expert_bytes
        return self.inner.fetch(layer, routing)

    def slot_tensors(self, layer):
        return self.inner.slot_tensors(layer)

    def slot_index(self, layer, ids):
        return self.inner.slot_index(layer, ids)

    def stats(self) -> dict:
        return {"bytes_moved": self.bytes_moved, "hits": 0, "misses": 0}

    def reset_stats(self) -> None:
        self.bytes_moved = 0

    bytes_moved = 0  # a plain counter attribute satisfies the abstract property


@pytest.fixture
def hit_count(monkeypatch):
    """An independent count of the draft set's hit rate: per `DraftExperts`, in creation order, the routing
    assignments of its verification forwards [hits, all], a hit being an assignment to an expert of the layer's
    draft set as the forward found it."""
    from specmoe.decoding.drafters.draft_experts import DraftExperts
    seen: dict = {}
    real = DraftExperts.observe

    def observe(self, layer, routing):
        n = seen.setdefault(self, [0, 0])
        if self.verifying and layer in self.ids:
            c = routing.counts.tolist()
            n[0] += sum(c[e] for e in self.ids[layer])
            n[1] += sum(c)
        real(self, layer, routing)
    monkeypatch.setattr(DraftExperts, "observe", observe)
    return seen


@pytest.mark.parametrize("family,N,gamma,substitution,policy", CONFIGS)
def test_greedy_specmoe_equals_plain_greedy(tiny_ckpt, hit_count, family, N, gamma, substitution, policy):
    path = tiny_ckpt(family)
    llm = LLM(path, decoding="specmoe", draft_experts=N, num_draft_tokens=gamma, substitution=substitution,
              draft_policy=policy)
    for batch in BATCHES:
        ps, sp = BATCHES[batch]
        got = [o.token_ids for o in llm.generate(ps, sp)]
        assert got == reference(path, batch), f"{batch}: speculative greedy differs from plain greedy"
    st = llm.stats
    assert len(st["acceptance_per_position"]) == gamma
    assert 1.0 <= st["tokens_per_step"] <= gamma + 1
    assert st["steps"] > 0 and st["draft_time_s"] > 0 and st["verify_time_s"] > 0
    hits, routed = list(hit_count.values())[-1]  # the last generate call's draft set
    assert routed > 0 and st["draft_set_hit_rate"] == hits / routed
    if N >= 8:  # every expert is a draft expert
        assert st["draft_set_hit_rate"] == 1.0
    else:
        assert st["draft_set_hit_rate"] < 1.0
    assert st["draft_phase_bytes"] == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_auto_and_continuous_batching_equal_plain_greedy(tiny_ckpt, family):
    """`auto` switches between AR and speculative steps; max_batch < prompts admits requests mid-run."""
    path = tiny_ckpt(family)
    ps, sp = BATCHES["b7"]
    ref = reference(path, "b7")
    for kw in (dict(decoding="auto"), dict(decoding="specmoe", max_batch=3)):
        llm = LLM(path, **kw)
        assert [o.token_ids for o in llm.generate(ps, sp)] == ref, kw
    st = LLM(path, decoding="auto")
    st.generate(*BATCHES["b64"])
    s = st.stats
    assert sum(s["controller_steps"].values()) == s["decode_steps"] > 0
    assert s["coefficients"]["ne_fixed"] > 0, "the controller reports its calibrated cost model"


def test_sampled_specmoe_is_seeded_and_greedy_rows_stay_exact(tiny_ckpt):
    path = tiny_ckpt("qwen3_moe")
    ps = prompts(6, 3)
    params = [SamplingParams(max_tokens=12, temperature=t, top_k=k, top_p=tp, seed=100 + i)
              for i, (t, k, tp) in enumerate([(1.0, 0, 1.0), (0.7, 10, 1.0), (1.3, 0, 0.8), (0.0, 0, 1.0),
                                              (1.0, 5, 0.9), (0.0, 0, 1.0)])]
    runs = [[o.token_ids for o in LLM(path, decoding="specmoe", num_draft_tokens=3).generate(ps, params)]
            for _ in range(2)]
    assert runs[0] == runs[1], "seeded sampled SpecMoE must repeat exactly"
    ref = [o.token_ids for o in LLM(path, decoding="ar").generate(ps, params)]
    assert runs[0][3] == ref[3] and runs[0][5] == ref[5], "greedy rows of a mixed batch equal plain greedy"
    assert all(len(r) == 12 for r in runs[0])


def test_drafting_moves_zero_bytes_and_pins_the_draft_set(tiny_ckpt):
    path = tiny_ckpt("olmoe")
    for policy in ("hot-temporal", "hot-global"):
        llm = LLM(path, decoding="specmoe", draft_experts=3, num_draft_tokens=4, draft_policy=policy)
        llm.store = counting = CountingProvider(llm.store)
        ps, sp = BATCHES["b7"]
        assert [o.token_ids for o in llm.generate(ps, sp)] == reference(path, "b7")
        st = llm.stats
        assert st["draft_phase_bytes"] == 0, "drafting must never touch the backing tier"
        assert counting.bytes_moved > 0, "verification does fetch non-draft experts (the counter is live)"
        assert counting.pins >= len(llm.config.moe_layers)
        for layer, ids in st["draft_set"].items():
            assert counting.resident(layer) == set(ids)
        if policy == "hot-temporal":
            assert st["draft_refresh_bytes"] == 0, "the refreshed set streamed by during verification"


def test_gamma_never_runs_past_max_tokens_or_context(tiny_ckpt):
    path = tiny_ckpt("mixtral")
    ps = prompts(3, 11, max_len=5)
    for kw in (dict(), dict(max_model_len=12)):
        ref = [o.token_ids for o in LLM(path, decoding="ar", **kw).generate(ps, SamplingParams(max_tokens=9))]
        got = [o.token_ids for o in LLM(path, decoding="specmoe", num_draft_tokens=6, **kw).generate(
            ps, SamplingParams(max_tokens=9))]
        assert got == ref


def test_a_step_never_emits_more_than_a_sequence_may(tiny_ckpt, monkeypatch):
    """The draft leaves room for the bonus token: with the draft equal to the target (every expert a draft
    expert, so every draft is accepted) a step emits at most what each sequence may still emit (max_tokens, the
    context), and some steps use all of it; nothing is cut after the fact."""
    from specmoe.decoding.strategies.speculative import SpeculativeDecoder
    real, seen = SpeculativeDecoder.step, []

    def step(self, inp):
        room = {s.seq_id: min(s.params.max_tokens - len(s.output_ids), self.max_model_len - s.num_tokens)
                for s in inp.seqs}
        out = real(self, inp)
        seen.extend((len(toks), room[i]) for i, toks in out.tokens.items())
        return out
    monkeypatch.setattr(SpeculativeDecoder, "step", step)
    path = tiny_ckpt("mixtral")
    for kw, max_tokens in ((dict(), 5), (dict(max_model_len=10), 9)):  # max_tokens, then the context binds
        seen.clear()
        LLM(path, decoding="specmoe", num_draft_tokens=6, draft_experts=8, **kw).generate(
            prompts(3, 11, max_len=5), SamplingParams(max_tokens=max_tokens))
        assert all(n <= r for n, r in seen), seen
        assert any(n == r > 1 for n, r in seen), seen


@pytest.mark.parametrize("policy", ["ondemand", "lru"])
def test_offloaded_cache_draft_moves_zero_bytes(tiny_ckpt, policy):
    """With the real expert cache (host tier): lossless, and bytes_moved never changes during a draft phase."""
    path = tiny_ckpt("qwen3_moe")
    llm = LLM(path, offload="host", cache_policy=policy, cache_experts=4, decoding="specmoe", draft_experts=3)
    ps, sp = BATCHES["b7"]
    assert [o.token_ids for o in llm.generate(ps, sp)] == reference(path, "b7")
    st = llm.stats
    assert st["draft_phase_bytes"] == 0 and st["bytes_moved"] > 0
    for layer, ids in st["draft_set"].items():
        assert set(ids) <= llm.store.resident(layer), "the draft set is pinned in the cache"



@pytest.mark.cuda
@pytest.mark.parametrize("offload", ["host", "disk"])
def test_cuda_specmoe_greedy_equals_plain_greedy(tiny_ckpt, offload):
    """On the device: SpecMoE over a bounded cache (pinned host RAM or SSD) equals plain greedy, and drafts."""
    path = tiny_ckpt("qwen3_moe")
    ps, sp = BATCHES["b7"]
    ref = [o.token_ids for o in LLM(path, device="cuda").generate(ps, sp)]
    llm = LLM(path, device="cuda", offload=offload, cache_experts=4, decoding="specmoe", draft_experts=3)
    assert [o.token_ids for o in llm.generate(ps, sp)] == ref
    st = llm.stats
    assert st["drafted_tokens"] > 0 and st["draft_phase_bytes"] == 0 and st["bytes_moved"] > 0


def test_draft_guided_prefetch_loads_what_verification_uses(tiny_ckpt):
    """draft_prefetch: the target routers' picks for drafted tokens load in the background while the draft
    computes; verification finds them resident. Output unchanged, and the draft itself fetches nothing."""
    path = tiny_ckpt("qwen3_moe")
    ps, sp = BATCHES["b7"]
    runs = {}
    for on in (False, True):
        llm = LLM(path, offload="host", cache_policy="lru", cache_experts=6, decoding="specmoe", draft_experts=2,
                  num_draft_tokens=4, draft_prefetch=on)
        assert [o.token_ids for o in llm.generate(ps, sp)] == reference(path, "b7")
        runs[on] = llm.stats
    off, on = runs[False], runs[True]
    assert off["draft_prefetch_bytes"] == 0 and off["prefetch_useful"] == 0
    assert on["draft_prefetch_bytes"] > 0 and on["prefetch_bytes"] >= on["draft_prefetch_bytes"]
    assert on["prefetch_useful"] > 0, "some prefetched experts were used by the verification"
    assert on["draft_phase_bytes"] == 0 == off["draft_phase_bytes"]
