"""The draft's parts: affinity table and its disk cache, substitution hooks, the draft reading its
pinned slots in place, draft-set profiles."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from specmoe.decoding.drafters import affinity as aff
from specmoe.decoding.drafters.draft_experts import DraftExperts, load_profile, top_n
from specmoe.experts.resident import ResidentExperts
from specmoe.models.moe import ForwardContext, MoEBlock, Routing, routed_experts
from specmoe.weights.checkpoint import Checkpoint


@pytest.fixture(scope="module")
def mixtral(tiny_ckpt):
    return Checkpoint(tiny_ckpt("mixtral"))


def test_affinity_table_is_l2_distance_and_cached_by_fingerprint(tiny_ckpt, monkeypatch):
    ck = Checkpoint(tiny_ckpt("olmoe", seed=3))
    table = aff.load_or_compute_affinity(ck)
    layer = ck.config.moe_layers[0]
    W = torch.stack([ck.read_expert(layer, e, torch.float64) for e in range(ck.config.num_experts)])
    assert torch.allclose(table[layer].double(), torch.cdist(W, W), atol=1e-4)
    assert (ck.path / ".specmoe" / "affinity.safetensors").is_file()

    def boom(_):
        raise AssertionError("recomputed although the cache is valid")
    monkeypatch.setattr(aff, "compute_affinity", boom)
    assert torch.equal(aff.load_or_compute_affinity(ck)[layer], table[layer])
    monkeypatch.setattr(Checkpoint, "fingerprint", lambda self: "other weights")
    with pytest.raises(AssertionError, match="recomputed"):
        aff.load_or_compute_affinity(ck)


def _drafter(ck, substitution, n, ids=None):
    cfg = ck.config
    prov = ResidentExperts(ck, torch.float32)
    d = DraftExperts(cfg, prov, num_draft=n, policy="random", substitution=substitution, seed=0,
                     device=torch.device("cpu"),
                     affinity=aff.compute_affinity(ck) if substitution == "affinity" else None)
    d.setup()
    if ids is not None:
        for layer in cfg.moe_layers:
            d.assign(layer, ids)
    return d, prov


@pytest.mark.parametrize("substitution", ["affinity", "mask", "random"])
@pytest.mark.parametrize("n", [1, 3])
def test_substitution_routes_only_to_draft_experts(mixtral, substitution, n):
    d, _ = _drafter(mixtral, substitution, n)
    layer = mixtral.config.moe_layers[0]
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(50, mixtral.config.num_experts, generator=g)
    probs = torch.softmax(logits, -1)
    w, ids = torch.topk(probs, 2)
    w = w / w.sum(-1, keepdim=True)
    w2, ids2 = d.routing_hook(layer, logits, w, ids)
    draft = set(d.ids[layer])
    assert set(ids2.unique().tolist()) <= draft
    keep = torch.tensor([[e in draft for e in row] for row in ids.tolist()])
    if substitution != "mask":
        assert torch.equal(ids2[keep], ids[keep]) and torch.equal(w2, w), "draft picks and weights are kept"
    else:
        assert ids2.shape[1] == min(2, n), "N < k: only N distinct experts"
        assert all(len(set(r)) == len(r) for r in ids2.tolist())
        assert torch.allclose(w2.sum(-1), torch.ones(50)), "Mixtral renormalises the re-routed top-k"


def _reference_experts(store, layer, x, w, ids):
    """Routed-expert output by a plain per-assignment loop over the store's packed experts (F.linear, no
    grouped op): the oracle for the grouped path."""
    D, I = x.shape[1], store.layers[layer].shape[1] // (3 * x.shape[1])
    out = torch.zeros_like(x)
    for n in range(x.shape[0]):
        for k in range(ids.shape[1]):
            buf = store.layers[layer][int(ids[n, k])]
            h = F.linear(x[n:n + 1], buf[:2 * I * D].view(2 * I, D))
            g, u = h.chunk(2, -1)
            out[n] += w[n, k] * F.linear(F.silu(g) * u, buf[2 * I * D:].view(D, I))[0]
    return out


@pytest.mark.parametrize("tokens", [1, 40])
@pytest.mark.parametrize("offload", ["none", "host"])
def test_draft_reads_pinned_slots_in_place(mixtral, tokens, offload):
    """The draft's experts are the store's own slots (no copy): its group points into the store's slot tensors,
    maps each draft expert to the slot it is pinned in, and computes what the target's path computes over the
    same experts (bit for bit: one grouped op), which equals a plain per-expert loop."""
    from specmoe.experts.cache import ExpertCache
    from specmoe.experts.tiers import HostTier
    cfg = mixtral.config
    resident = ResidentExperts(mixtral, torch.float32)
    store = resident if offload == "none" else ExpertCache(HostTier(mixtral, torch.float32, pin=False), cfg, slots=6)
    d = DraftExperts(cfg, store, num_draft=4, policy="random", substitution="mask", seed=0,
                     device=torch.device("cpu"))
    d.setup()
    layer = cfg.moe_layers[1]
    d.assign(layer, d.ids[layer])
    group = d.groups[layer]
    gate_up, down, _, _ = store.slot_tensors(layer)
    assert group.gate_up.data_ptr() == gate_up.data_ptr() and group.down.data_ptr() == down.data_ptr()
    _assert_slots_hold(d, resident, layer)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, cfg.hidden_size, generator=g)
    ids = d.ids_t[layer][torch.randint(4, (tokens, 2), generator=g)]
    w = torch.rand(tokens, 2, generator=g)
    got = routed_experts(x, Routing(ids, w, cfg.num_experts), [group])
    target = MoEBlock(cfg, layer).experts_forward(x, w, ids, ForwardContext(provider=resident))
    assert torch.equal(got, target), "the draft runs the target's own grouped op"
    assert torch.allclose(got, _reference_experts(resident, layer, x, w, ids), atol=1e-5)
    # the draft forward never reaches the provider
    with pytest.raises(AssertionError, match="draft tried to fetch"):
        MoEBlock(cfg, layer).experts_forward(x, w, ids, ForwardContext(provider=d.context().provider))


def _assert_slots_hold(d, resident, layer):
    """The slot each draft expert maps to holds that expert's weights, bit for bit."""
    cfg = d.cfg
    D, I = cfg.hidden_size, cfg.expert_intermediate_size
    group = d.groups[layer]
    S = group.gate_up.shape[0]
    slot_of = group.slot_of.tolist()
    assert sorted(e for e, s in enumerate(slot_of) if s < S) == sorted(d.ids[layer])
    for e in d.ids[layer]:
        buf = resident.layers[layer][e]
        assert torch.equal(group.gate_up[slot_of[e]], buf[:2 * I * D].view(2 * I, D))
        assert torch.equal(group.down[slot_of[e]], buf[2 * I * D:].view(D, I))


def test_hot_temporal_refresh_repoints_the_draft_at_pinned_slots(tiny_ckpt, monkeypatch):
    """A verification that routes to other experts refreshes the set: the arriving experts are pinned as the
    forward brings them in, and the draft's map points at their slots; no expert is copied."""
    from specmoe import LLM, SamplingParams
    seen = {"refreshed": 0}
    orig = DraftExperts.end_target

    def checked(self):
        before = {layer: list(ids) for layer, ids in self.ids.items()}
        orig(self)
        for layer in self.ids:
            assert self.groups[layer].gate_up.data_ptr() == self.provider.slot_tensors(layer)[0].data_ptr()
            _assert_slots_hold(self, resident, layer)
            seen["refreshed"] += set(self.ids[layer]) != set(before[layer])
    monkeypatch.setattr(DraftExperts, "end_target", checked)
    resident = ResidentExperts(Checkpoint(tiny_ckpt("olmoe")), torch.float32)
    llm = LLM(tiny_ckpt("olmoe"), decoding="specmoe", draft_experts=3, num_draft_tokens=3, offload="host",
              cache_experts=6)
    llm.generate([[90, 91, 92, 93, 94, 95], [40, 41, 42, 43], [1, 2, 3]],
                 SamplingParams(max_tokens=12, ignore_eos=True))
    assert seen["refreshed"] > 0, "some verification changed a draft set"
    st = llm.stats
    assert st["draft_set_refreshes"] > 0 and st["draft_refresh_bytes"] == 0


def test_draft_set_larger_than_the_cache_is_a_clear_error(tiny_ckpt):
    from specmoe import LLM, SamplingParams
    from specmoe.errors import InputError
    llm = LLM(tiny_ckpt("olmoe"), decoding="specmoe", draft_experts=5, offload="host", cache_experts=3)
    with pytest.raises(InputError, match="draft_experts=5 cannot stay resident"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))


def test_profile_formats_and_top_n(tmp_path, mixtral):
    cfg = mixtral.config
    rows = [[e * (layer + 1) for e in range(cfg.num_experts)] for layer in range(cfg.num_layers)]
    (tmp_path / "expert_profile.json").write_text(json.dumps({"counts": rows, "tokens": 10}))
    prof = load_profile(tmp_path, cfg)
    assert prof[cfg.moe_layers[0]] == rows[cfg.moe_layers[0]]
    (tmp_path / "expert_profile.json").write_text(json.dumps(rows[: len(cfg.moe_layers)]))
    assert load_profile(tmp_path, cfg)[cfg.moe_layers[-1]] == rows[len(cfg.moe_layers) - 1]
    assert top_n([5, 1, 5, 0, 3], 2) == [0, 2]
    assert top_n([5, 1, 5, 0, 0], 4, prefer={4}) == [0, 1, 2, 4], "ties go to the resident set"


def test_counts_ignore_padding_rows(mixtral):
    """A ragged target forward pads short sequences; the draft-set counts see real tokens only."""
    from specmoe.decoding.runtime.runner import ModelRunner
    from specmoe.decoding.runtime.sampling import SamplingParams
    from specmoe.decoding.runtime.sequence import Sequence
    from specmoe.models.kv_cache import KVCache
    from specmoe.models.loader import load_model
    cfg = mixtral.config
    d, prov = _drafter(mixtral, "mask", 2)
    cache = KVCache(num_layers=cfg.num_layers, max_batch=2, max_seq=16, num_kv_heads=cfg.num_kv_heads,
                    head_dim=cfg.head_dim, dtype=torch.float32)
    runner = ModelRunner(load_model(mixtral, dtype=torch.float32), prov, cache, torch.device("cpu"))
    runner.observers.append(d.observe)
    seqs = [Sequence(seq_id=i, prompt_ids=p, params=SamplingParams(), slot=i, generator=torch.Generator())
            for i, p in enumerate([[1, 2, 3, 4, 5], [6]])]  # 6 real tokens, 4 padding rows
    runner.forward(seqs, [s.prompt_ids for s in seqs])
    d.resolve_counts()  # a resident store's counts stay on the device until read
    for layer in cfg.moe_layers:
        assert sum(d.last_counts[layer]) == 6 * cfg.top_k


def test_affinity_is_computed_once_per_engine(tiny_ckpt, monkeypatch):
    """A second generate call reuses the engine's affinity table."""
    from specmoe import LLM, SamplingParams
    import specmoe.decoding.drafters.affinity as affinity_mod
    calls = {"affinity": 0}
    load = affinity_mod.load_or_compute_affinity

    def counted_load(ck):
        calls["affinity"] += 1
        return load(ck)
    monkeypatch.setattr(affinity_mod, "load_or_compute_affinity", counted_load)
    llm = LLM(tiny_ckpt("mixtral"), decoding="specmoe", substitution="affinity", draft_experts=2)
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    first = llm.generate([[1, 2, 3]], sp)[0].token_ids
    assert calls["affinity"] == 1, "the first run loads the table"
    assert llm.generate([[1, 2, 3]], sp)[0].token_ids == first
    assert calls["affinity"] == 1, "the second run loaded nothing again"
