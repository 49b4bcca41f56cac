"""The draft's parts: affinity table and its disk cache, substitution hooks, the grouped draft-expert
op and draft-set profiles."""
from __future__ import annotations

import json

import pytest
import torch

from specmoe.decoding import affinity as aff
from specmoe.decoding.draft import DraftExperts, load_profile, top_n
from specmoe.experts.resident import ResidentExperts
from specmoe.models.moe import ForwardContext, MoEBlock
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


@pytest.mark.parametrize("tokens", [1, 40])
def test_grouped_draft_op_equals_sparse_path(mixtral, tokens):
    cfg = mixtral.config
    d, prov = _drafter(mixtral, "affinity", 4, ids=[0, 2, 5, 7])
    layer = cfg.moe_layers[1]
    g = torch.Generator().manual_seed(1)
    x = torch.randn(tokens, cfg.hidden_size, generator=g)
    ids = torch.tensor([0, 2, 5, 7])[torch.randint(4, (tokens, 2), generator=g)]
    w = torch.rand(tokens, 2, generator=g)
    block = MoEBlock(cfg, layer)
    ref = block.experts_forward(x, w, ids, ForwardContext(provider=prov))
    assert torch.allclose(d.experts_override(layer, x, w, ids), ref, atol=1e-5)
    loc = d.local[layer][ids]
    assert torch.allclose(d._dense(layer, x, w, loc), ref, atol=1e-5), "dense form"
    assert torch.equal(d._grouped(layer, x, w, loc), ref), "the grouped form is the target's own computation"
    # the calibration measured both forms at every token count and picked the grouped one from a count on
    assert set(d.calibration) == {1, 8, 64, "grouped_from"} and all(set(d.calibration[n]) == {"dense", "grouped"}
                                                                          for n in (1, 8, 64))
    d.sparse_from = 1  # whichever the machine chose, both forms run through experts_override
    assert torch.equal(d.experts_override(layer, x, w, ids), ref)
    d.sparse_from = None
    assert torch.allclose(d.experts_override(layer, x, w, ids), ref, atol=1e-5)
    _assert_stacks_hold(d, prov, layer)


def _assert_stacks_hold(d, prov, layer):
    """Row i of the draft's stacks is expert d.ids[layer][i], bit for bit."""
    cfg = d.cfg
    D, I = cfg.hidden_size, cfg.expert_intermediate_size
    for i, e in enumerate(d.ids[layer]):
        buf = prov.layers[layer][e]
        assert torch.equal(d.w1[layer][i], buf[:2 * I * D].view(2 * I, D))
        assert torch.equal(d.w2cat[layer][:, i * I:(i + 1) * I], buf[2 * I * D:].view(D, I))


def test_hot_temporal_refresh_copies_arriving_experts_in_place(tiny_ckpt, monkeypatch):
    """A verification that routes to other experts refreshes the set: the arriving experts are copied into
    the rows of the leaving ones as the fetch streams them by; the stacks are never re-allocated."""
    from specmoe import LLM, SamplingParams
    seen = {"refreshed": 0}
    orig = DraftExperts.end_target

    def checked(self):
        before = {layer: list(ids) for layer, ids in self.ids.items()}
        ptrs = {layer: (self.w1[layer].data_ptr(), self.w2cat[layer].data_ptr()) for layer in self.ids}
        orig(self)
        for layer in self.ids:
            assert (self.w1[layer].data_ptr(), self.w2cat[layer].data_ptr()) == ptrs[layer], "re-allocated"
            _assert_stacks_hold(self, resident, layer)
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
    from specmoe.decoding.runner import ModelRunner
    from specmoe.decoding.sampling import SamplingParams
    from specmoe.decoding.sequence import Sequence
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
    for layer in cfg.moe_layers:
        assert sum(d.last_counts[layer]) == 6 * cfg.top_k


def test_affinity_and_calibration_are_computed_once_per_engine(tiny_ckpt, monkeypatch):
    """A second generate call reuses the engine's affinity table and the draft's form calibration."""
    from specmoe import LLM, SamplingParams
    import specmoe.decoding.affinity as affinity_mod
    import specmoe.decoding.draft as draft_mod
    calls = {"affinity": 0, "timer": 0}
    load, timer = affinity_mod.load_or_compute_affinity, draft_mod.now

    def counted_load(ck):
        calls["affinity"] += 1
        return load(ck)

    def counted_timer(dev):
        calls["timer"] += 1
        return timer(dev)
    monkeypatch.setattr(affinity_mod, "load_or_compute_affinity", counted_load)
    monkeypatch.setattr(draft_mod, "now", counted_timer)
    llm = LLM(tiny_ckpt("mixtral"), decoding="specmoe", substitution="affinity", draft_experts=2)
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    first = llm.generate([[1, 2, 3]], sp)[0].token_ids
    after_first = dict(calls)
    assert after_first["affinity"] == 1 and after_first["timer"] > 0, "the first run loads and calibrates"
    assert llm.generate([[1, 2, 3]], sp)[0].token_ids == first
    assert calls == after_first, "the second run measured or loaded nothing again"
    assert "grouped_from" in llm.draft_memo["calibration"]
