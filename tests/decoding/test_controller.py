"""decoding="auto": the controller's plain / speculative steps keep greedy output equal to plain AR (fp32,
every batch), plain steps do what AR steps do (no draft-set maintenance), the in-draft stopping rule,
draft-guided prefetch's precision / recall, and the calibrated cost model's choices (what it learns from measured
steps: `test_controller_feedback.py`; reusing a call: `test_controller_coasting.py`)."""
from __future__ import annotations

import numpy as np
import pytest

from specmoe import LLM
from specmoe.decoding.control.controller import Controller
from specmoe.decoding.control.costmodel import Coefficients, CostModel
from specmoe.decoding.control.routing import RoutingStats
from specmoe.engine.auto import controller_of

from tests.decoding.test_specmoe import BATCHES, reference

OFFLOAD = dict(offload="host", cache_experts=4, dtype="float32")


def auto_llm(path, **kw):
    return LLM(path, decoding="auto", **{**OFFLOAD, **kw})


def run_all(llm, path):
    for batch in BATCHES:
        ps, sp = BATCHES[batch]
        assert [o.token_ids for o in llm.generate(ps, sp)] == reference(path, batch), batch


@pytest.mark.parametrize("family", ("mixtral", "qwen3_moe"))
def test_greedy_equals_ar_with_forced_plain_forced_spec_and_mixed_steps(tiny_ckpt, family):
    path = tiny_ckpt(family)
    kinds = {}
    for mode in ("plain", "spec", "mixed", "model"):
        llm = auto_llm(path)
        ctl = controller_of(llm)
        if mode == "mixed":
            ctl.schedule = lambda i: ("spec", "plain", "plain")[i % 3]
        elif mode != "model":
            ctl.force = mode
        run_all(llm, path)
        kinds[mode] = dict(ctl.choices)
        if mode == "spec":  # every planned step tells the drafter's calibration what its plan expected
            assert ctl.acc.plan_pred[0] > 0 and ctl.acc.plan_acc[0] > 0
    assert kinds["plain"]["spec"] == 0 and kinds["plain"]["plain"] > 0
    assert kinds["spec"]["plain"] <= 3 and kinds["spec"]["spec"] > 0  # plain only where no sequence may draft
    assert kinds["mixed"]["spec"] > 0 and kinds["mixed"]["plain"] > kinds["mixed"]["spec"]
    assert sum(kinds["model"].values()) > 0


def test_plain_steps_do_what_ar_steps_do(tiny_ckpt):
    """Forced plain moves exactly AR's bytes with AR's hits (no draft set is set up or pinned); after a few
    speculative steps a plain stretch unpins the draft set and never refreshes it."""
    path = tiny_ckpt("olmoe")
    ps, sp = BATCHES["b7"]
    ar = LLM(path, decoding="ar", **OFFLOAD)
    ar.generate(ps, sp)
    auto = auto_llm(path)
    controller_of(auto).force = "plain"  # builds the controller: calibration reads a few experts
    auto.reset_stats()
    auto.generate(ps, sp)
    a, b = ar.stats, auto.stats
    assert b["ar_steps"] == b["decode_steps"] and b["steps"] == 0
    assert (b["bytes_moved"], b["hits"], b["misses"]) == (a["bytes_moved"], a["hits"], a["misses"])
    assert b["draft_set_refreshes"] == 0 and b["draft_setup_bytes"] == 0

    mixed = auto_llm(path)
    ctl = controller_of(mixed)
    ctl.schedule = lambda i: "spec" if i < 2 else "plain"
    ps, sp = BATCHES["b1"]
    assert [o.token_ids for o in mixed.generate(ps, sp)] == reference(path, "b1")
    st = mixed.stats
    assert st["steps"] == 2 and st["ar_steps"] > mixed.spec_cfg.num_draft_tokens
    assert st["draft_set_refreshes"] <= 2, "plain steps must not refresh the draft set"
    assert st["draft_set_unpins"] == 1, "a plain stretch gives the draft set's slots back"
    assert all(not mixed.store.layers[layer].pinned for layer in mixed.config.moe_layers)


def test_stopping_rule_shortens_drafts_and_keeps_output(tiny_ckpt):
    path = tiny_ckpt("qwen3_moe")
    drafted = {}
    for p_min in (0.0, 0.999):  # tiny random models draft with low confidence: with 0.999 rows stop early
        llm = auto_llm(path, num_draft_tokens=4)
        ctl = controller_of(llm)
        ctl.force, ctl.p_min = "spec", p_min
        run_all(llm, path)
        drafted[p_min] = (llm.stats["drafted_tokens"], llm.stats["controller_draft_stops"])
    assert drafted[0.0][1] == 0 and drafted[0.999][1] > 0
    assert drafted[0.999][0] < drafted[0.0][0], drafted


def test_draft_prefetch_reports_precision_and_recall(tiny_ckpt):
    path = tiny_ckpt("mixtral")
    llm = LLM(path, decoding="specmoe", draft_prefetch=True, draft_experts=2, **{**OFFLOAD, "cache_experts": 6})
    ps, sp = BATCHES["b7"]
    assert [o.token_ids for o in llm.generate(ps, sp)] == reference(path, "b7")
    st = llm.stats
    assert st["draft_prefetch_bytes"] > 0
    assert 0 < st["draft_prefetch_precision"] <= 1 and 0 < st["draft_prefetch_recall"] <= 1


def synthetic(read_s: float, *, ne=2e-3, exp=1e-4, E=16, L=4, K=2, N=4, gamma=4):
    c = Coefficients(ne_fixed=ne, ne_per_token=ne / 50, layer_fixed=1e-4, draft_fixed=ne + L * N * exp,
                     draft_per_token=ne / 50 + L * N * exp / 20, exp_fixed=exp, exp_per_row=exp / 20,
                     read_s=read_s, read_latency_s=read_s / 4, expert_bytes=1 << 20, moe_layers=L, top_k=K,
                     num_experts=E)
    cm = CostModel(c, RoutingStats(list(range(L)), E, K), draft_experts=N)
    ctl = Controller(cm, gamma)
    ctl.PER_ROW = True  # the per-row arms too (the planning these tests check; `auto` offers them on request)
    return ctl, np.zeros((L, E), bool), cm.routing.hottest(N)


def test_controller_speculates_exactly_when_fetches_dominate():
    slow, res, spec_res = synthetic(read_s=20e-3)  # a slow link: every miss costs 10 forwards
    fast, _, _ = synthetic(read_s=1e-6, ne=10e-3, exp=1e-5)  # experts almost free: drafting is pure overhead
    for ctl in (slow, fast):
        ctl.acc.record(list(range(8)), [4] * 8, [3] * 8, [[0.9] * 4] * 8)  # good acceptance measured
        ctl.measured.min_steps = 0  # the model's choice (no exploration of an untried drafter)
    p = slow.plan(list(range(8)), [4] * 8, res, spec_res)
    assert p.kind == "spec" and p.spec_rate > p.plain_rate and max(p.gammas) >= 2
    q = fast.plan(list(range(8)), [4] * 8, res, spec_res)
    assert q.kind == "plain" and q.plain_rate > q.spec_rate


def test_per_sequence_gamma_follows_each_sequences_acceptance():
    ctl, res, spec_res = synthetic(read_s=5e-3)
    ctl.measured.min_steps = 0  # the model's choice (no trials)
    for _ in range(20):  # sequence 0 accepts everything, sequence 1 nothing
        ctl.acc.record([0, 1], [4, 4], [4, 0], [[0.9] * 4, [0.2]])
    p = ctl.plan([0, 1], [4, 4], res, spec_res)
    assert p.kind == "spec" and p.gammas[0] > p.gammas[1], p
    capped = ctl.plan([0, 1], [1, 0], res, spec_res)
    assert capped.kind == "spec" and capped.gammas == [1, 0], ("limits cap γ_b", capped)


@pytest.mark.parametrize("family", ("gpt_oss", "deepseek_v3"))
def test_mixed_steps_equal_ar_on_families_with_expert_biases_and_mla(tiny_ckpt, family):
    """The calibration runs the family's own expert and KV layout (biases, clamped SwiGLU; MLA's latent cache)."""
    path = tiny_ckpt(family)
    ps, sp = BATCHES["b7"]
    ref = [o.token_ids for o in LLM(path, decoding="ar").generate(ps, sp)]
    llm = auto_llm(path)
    ctl = controller_of(llm)
    ctl.schedule = lambda i: ("spec", "plain")[i % 2]
    assert [o.token_ids for o in llm.generate(ps, sp)] == ref
    assert ctl.choices["spec"] > 0 and ctl.choices["plain"] > 0 and ctl.cost.c.ne_fixed > 0


def test_ragged_drafts_pay_for_their_padding_and_uniform_caps_are_candidates():
    """A verification's rows are padded to the longest: the non-expert model runs B × (1 + max γ) tokens, so a
    ragged plan costs more than a uniform one with the same Σγ, and every θ plan is also offered capped at each
    common depth."""
    from specmoe.decoding.control.candidates import candidates
    ctl, res, spec_res = synthetic(read_s=1e-6, ne=10e-3)  # experts almost free: the non-expert model dominates
    W = np.zeros((2, 2), int)
    Gm = np.array([[4, 0], [2, 2]])
    ctl.resident, ctl.spec_resident = res, spec_res
    _, v, _, _ = ctl._costs(W, Gm, ["self"], res, spec_res, {}, {})
    assert v[0] > v[1]  # 2 × 5 tokens through the non-expert model against 2 × 3
    P = np.array([[0.95, 0.9, 0.85, 0.8], [0.9, 0.5, 0.3, 0.1]])
    cand = candidates(["self"], {"self": P}, {"self": P}, {"self": [4, 4]}, 2, 4)
    plans = {tuple(cand.Gm[c]) for c in cand.idx}
    assert (4, 4) in plans and (2, 2) in plans and (4, 2) in plans and (1, 1) in plans


@pytest.mark.parametrize("how", ["constructor", "use"])
def test_every_drafter_is_planned_over_not_only_the_first(how):
    """A controller given two drafters plans over both: when the second one accepts everything and the first
    nothing, every row drafts with the second (a controller that looked only at its first drafter would draft
    with the failing one, or not at all)."""
    base, res, spec_res = synthetic(read_s=20e-3)
    if how == "constructor":
        ctl = Controller(base.cost, base.g, ("self", "eagle"))
    else:
        ctl = base
        ctl.use(["self", "eagle"])
    ctl.measured.min_steps = 0
    ids, lim = list(range(8)), [4] * 8
    for _ in range(20):
        ctl.accs["self"].record(ids, [4] * 8, [0] * 8, [[0.9] * 4] * 8)
        ctl.accs["eagle"].record(ids, [4] * 8, [4] * 8, [[0.9] * 4] * 8)
    p = ctl.choose(ids, {"self": lim, "eagle": lim}, res, spec_res)
    assert p.kind == "spec" and p.drafter_of == ["eagle"] * 8, p
    assert set(ctl.arm_rates) >= {"plain", "eagle"}
