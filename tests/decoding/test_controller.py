"""decoding="auto": the controller's plain / speculative steps keep greedy output equal to plain AR (fp32,
every batch), plain steps do what AR steps do (no draft-set maintenance), the in-draft stopping rule,
draft-guided prefetch's precision / recall, and the calibrated cost model's choices."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from specmoe import LLM
from specmoe.decoding.control import costmodel as cmod
from specmoe.decoding.control.controller import Controller
from specmoe.decoding.control.learning import Realized
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


def test_calibration_is_cached_per_key_and_rebuilt_when_corrupt(tiny_ckpt, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = tiny_ckpt("mixtral")
    llm = auto_llm(path)
    c = controller_of(llm).cost.c
    assert c.source == "measured" and c.ne_fixed > 0 and c.exp_per_row >= 0 and c.read_s > 0
    files = list((cmod.cache_root() / "costmodel").glob("*.json"))
    assert files and all(json.loads(f.read_text())["expert_bytes"] > 0 for f in files)
    again = auto_llm(path)
    assert controller_of(again).cost.c.source == "cached"
    for f in files:
        f.write_text("{not json")
    assert controller_of(auto_llm(path)).cost.c.source == "measured"


def synthetic(read_s: float, *, ne=2e-3, exp=1e-4, E=16, L=4, K=2, N=4, gamma=4):
    c = Coefficients(ne_fixed=ne, ne_per_token=ne / 50, layer_fixed=1e-4, draft_fixed=ne + L * N * exp,
                     draft_per_token=ne / 50 + L * N * exp / 20, exp_fixed=exp, exp_per_row=exp / 20,
                     read_s=read_s, read_latency_s=read_s / 4, expert_bytes=1 << 20, moe_layers=L, top_k=K,
                     num_experts=E)
    cm = CostModel(c, RoutingStats(list(range(L)), E, K), draft_experts=N)
    return Controller(cm, gamma), np.zeros((L, E), bool), cm.routing.hottest(N)


def test_controller_speculates_exactly_when_fetches_dominate():
    slow, res, spec_res = synthetic(read_s=20e-3)  # a slow link: every miss costs 10 forwards
    fast, _, _ = synthetic(read_s=1e-6, ne=10e-3, exp=1e-5)  # experts almost free: drafting is pure overhead
    for ctl in (slow, fast):
        ctl.acc.record(list(range(8)), [4] * 8, [3] * 8, [[0.9] * 4] * 8)  # good acceptance measured
        ctl.MIN_TRIALS = 0  # the model's choice (no exploration of an untried drafter)
    p = slow.plan(list(range(8)), [4] * 8, res, spec_res)
    assert p.kind == "spec" and p.spec_rate > p.plain_rate and max(p.gammas) >= 2
    q = fast.plan(list(range(8)), [4] * 8, res, spec_res)
    assert q.kind == "plain" and q.plain_rate > q.spec_rate


def test_per_sequence_gamma_follows_each_sequences_acceptance():
    ctl, res, spec_res = synthetic(read_s=5e-3)
    for _ in range(20):  # sequence 0 accepts everything, sequence 1 nothing
        ctl.acc.record([0, 1], [4, 4], [4, 0], [[0.9] * 4, [0.2]])
    p = ctl.plan([0, 1], [4, 4], res, spec_res)
    assert p.kind == "spec" and p.gammas[0] > p.gammas[1], p
    assert ctl.plan([0, 1], [1, 0], res, spec_res).gammas in (None, [1, 0]), "limits cap γ_b"


def test_cost_model_refines_from_measured_steps():
    ctl, res, spec_res = synthetic(read_s=1e-3)
    cm = ctl.cost
    raw = cm.plain(4, res, refined=False)
    for _ in range(30):
        cm.refine(cm.fwd(4), 4, 2 * raw, raw)
    assert cm.plain(4, res) == pytest.approx(2 * raw, rel=0.05)
    assert cm.plain(64, res) / cm.plain(64, res, refined=False) == pytest.approx(2, rel=0.05), \
        "an unmeasured bucket takes the nearest measured one"
    d, v, ref = cm.spec_parts(np.array([[3, 0, 0, 0]]), spec_res)  # 7 tokens verified: the forwards' ratio
    assert ref[0] == pytest.approx(2 * (d[0] + v[0]), rel=0.05), "an unmeasured draft phase takes the forwards' ratio"
    for _ in range(30):
        cm.refine("draft", 4, 3 * d[0], d[0])
    assert cm.spec_parts(np.array([[3, 0, 0, 0]]), spec_res)[2][0] == pytest.approx(3 * d[0] + 2 * v[0], rel=0.05)
    for _ in range(30):  # batch 1's own forwards, once measured, price batch 1 (not batch 4's at the same tokens)
        cm.refine(cm.fwd(1), 2, raw, raw)
    assert cm.ratio(cm.fwd(1), 3) == pytest.approx(1.0, rel=0.05) and cm.ratio(cm.fwd(4), 3) == pytest.approx(2, rel=0.05)
    for _ in range(30):  # a token count measured slow once, then not chosen, fades to the freshly measured one
        cm.refine(cm.fwd(2), 4, 3 * raw, raw)
    assert cm.ratio(cm.fwd(2), 4) == pytest.approx(3, rel=0.05)
    for _ in range(128):
        cm.refine(cm.fwd(2), 2, raw, raw)
    assert cm.ratio(cm.fwd(2), 4) == pytest.approx(1, rel=0.1), "the old points' weight has decayed"
    cm.refine_overhead("spec", 8, 0.024, tokens=24)  # a verification of 8 rows padded to 3 positions
    assert cm.overhead("spec", 8, 40) == pytest.approx(0.04), "deeper drafts pay the acceptance over their padding"


def test_forward_corrections_price_each_draft_length_apart():
    """Within a batch bucket the forwards' measured / predicted ratio is a line in log2(tokens per row): 3 and 4
    tokens at batch 1 are priced apart (a ratio per token-count bucket priced them alike and so favoured the
    longest draft a bucket holds), the line is not extrapolated past half a doubling beyond what was measured, and
    it survives a round trip through the controller's memory."""
    ctl, res, spec_res = synthetic(read_s=1e-3)
    cm = ctl.cost
    for _ in range(40):
        for n in (1, 2, 3, 4, 5):
            cm.refine(cm.fwd(1), n, 1 + 0.3 * math.log2(n), 1.0)
    for n in (1, 3, 4, 5):
        assert cm.ratio(cm.fwd(1), n) == pytest.approx(1 + 0.3 * math.log2(n), rel=0.02)
    assert cm.ratio(cm.fwd(1), 3) < cm.ratio(cm.fwd(1), 4)
    assert cm.ratio(cm.fwd(1), 64) == pytest.approx(1 + 0.3 * (math.log2(5) + 0.5), rel=0.02), "clamped"
    assert cm.ratio(cm.fwd(2), 6) == pytest.approx(1 + 0.3 * math.log2(3), rel=0.02), "nearest batch, same tokens/row"
    twin = synthetic(read_s=1e-3)[0].cost
    twin.warm(json.loads(json.dumps(cm.state())))
    assert twin.ratio(twin.fwd(1), 3) == pytest.approx(cm.ratio(cm.fwd(1), 3))
    fit = cm.stats()["fwd_refinement"]["fwd/1"]
    assert fit["b"] == pytest.approx(0.3, rel=0.05) and (fit["x_lo"], fit["x_hi"]) == (0.0, pytest.approx(math.log2(5)))


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


def test_a_drafter_that_lost_on_a_few_unlucky_rows_is_tried_again():
    """Arms are scored on unbiased estimates, but whether a drafter left unused is worth a trial is decided on
    upper-confidence ones whose bonus grows with the steps taken: a drafter whose first rows were all rejected is
    not written off for good (the choice that left `auto` all-plain)."""
    ctl, res, spec_res = synthetic(read_s=5e-3)
    ids, lim = list(range(8)), [4] * 8
    ctl.acc.record(ids, [4] * 8, [0] * 8, [[0.9] * 4] * 8)  # eight unlucky rows
    ctl.realized.record("self", 8, 1.0, 1.0, 0)  # drafted in a measured step at this batch size
    first = ctl.plan(ids, lim, res, spec_res)
    assert first.kind == "plain" and first.reason == "model"
    ctl.steps, ctl.coasting = 80 * ctl.explore_every, (0, 0)  # many steps later, the drafter unused since
    again = ctl.plan(ids, lim, res, spec_res)
    assert again.kind == "spec" and again.reason == "explore"
    for _ in range(200):  # once it has drafted many rows and keeps failing, it stays out
        ctl.acc.record(ids, [4] * 8, [0] * 8, [[0.9] * 4] * 8)
    ctl.coasting, ctl.last_arm = (0, 0), "plain"  # (near a tie the last arm stays: hysteresis, tested below)
    q = ctl.plan(ids, lim, res, spec_res)
    assert q.kind == "plain" and q.spec_rate < q.plain_rate



def test_an_arm_whose_steps_measure_slower_than_predicted_is_priced_so_until_it_fades():
    """The measured / predicted step time of an arm (here the self draft's speculation) scales its predicted
    rate once it has Realized.MIN_STEPS steps; a correction not refreshed fades back to the model's."""
    ctl, res, spec_res = synthetic(read_s=5e-3)
    ids, lim = list(range(8)), [4] * 8
    ctl.acc.record(ids, [4] * 8, [3] * 8, [[0.9] * 4] * 8)
    p = ctl.plan(ids, lim, res, spec_res)
    assert p.kind == "spec" and p.arm == "self"
    for k in range(Realized.MIN_STEPS):
        ctl.realized.record("self", 8, 6 * p.predicted_s, p.predicted_s, ctl.steps)  # 6x slower than modelled
        ctl.realized.record("plain", 8, 1.0, 1.0, ctl.steps)
    assert ctl.realized.slowdown("self", 8, ctl.steps) == pytest.approx(6.0)
    ctl.coasting = (frozenset(), 0)
    q = ctl.plan(ids, lim, res, spec_res)
    assert q.kind == "plain" and q.spec_rate == pytest.approx(p.spec_rate / 6, rel=0.05)
    ctl.steps += 20 * int(Realized.FADE)  # long unused: back to the model's price
    ctl.coasting = (frozenset(), 0)
    assert ctl.plan(ids, lim, res, spec_res).kind == "spec"


def test_plain_steps_measured_long_ago_are_re_measured_while_speculating_near_a_tie():
    """Speculation is compared against plain's realized rate: while the speculative arm wins by little, a plain step
    measured `explore_every` steps ago is taken again (an exploration), then the model's choice resumes."""
    ctl, res, spec_res = synthetic(read_s=1.2e-4)  # speculation predicted ~18% faster than plain
    ids = list(range(8))
    ctl.acc.record(ids, [4] * 8, [2] * 8, [[0.9] * 4] * 8)
    ctl.realized.record("self", 8, 1.0, 1.0, 0)
    ctl.realized.record("plain", 8, 1.0, 1.0, 0)
    ctl.last_arm = "self"
    assert ctl.plan(ids, [4] * 8, res, spec_res).kind == "spec"  # plain measured recently
    ctl.steps, ctl.spec_coasting = 2 * ctl.explore_every + 1, None
    p = ctl.plan(ids, [4] * 8, res, spec_res)
    assert p.kind == "plain" and p.reason == "explore" and ctl.last_arm == "self"
    ctl.realized.record("plain", 8, 1.0, 1.0, ctl.steps)
    assert ctl.plan(ids, [4] * 8, res, spec_res).kind == "spec"


def test_realized_rates_compare_seconds_per_emitted_token_as_ratios_of_sums():
    """An arm whose rows emit fewer tokens than its prediction expected is priced slower by that ratio (over the
    last TOKEN_WINDOW steps), its time by the last WINDOW steps; one-token steps do not dominate (ratios of sums)."""
    r = Realized()
    for i in range(Realized.TOKEN_WINDOW):  # on time, but half the expected tokens half the time
        r.record("eagle", 1, 0.01, 0.01, i, emitted=1.0 if i % 2 else 3.0, expected=3.0)
    assert r.slowdown("eagle", 1, Realized.TOKEN_WINDOW - 1) == pytest.approx(6.0 / 4.0)  # Σ expected / Σ emitted
    for i in range(Realized.WINDOW):  # the latest steps take twice their predicted time, emitting as expected
        r.record("eagle", 1, 0.02, 0.01, 100 + i, emitted=3.0, expected=3.0)
    tokens = (6 * Realized.TOKEN_WINDOW / 2) / ((4 * (Realized.TOKEN_WINDOW - Realized.WINDOW) / 2)
                                                + 3 * Realized.WINDOW)
    assert r.slowdown("eagle", 1, 99 + Realized.WINDOW) == pytest.approx(2.0 * tokens)


def test_every_arm_pays_the_steps_cost_outside_the_model():
    """What steps measure outside the model's pricing (the plan, the controller's learning, the engine's loop)
    is added to every arm's step: it lowers plain's rate more than a speculative arm's, which emits more tokens per
    step."""
    ctl, res, spec_res = synthetic(read_s=1.2e-4)
    ids = list(range(8))
    ctl.acc.record(ids, [4] * 8, [2] * 8, [[0.9] * 4] * 8)
    ctl.realized.record("self", 8, 1.0, 1.0, 0)
    p = ctl.plan(ids, [4] * 8, res, spec_res)
    ctl.spec_coasting, ctl.coasting = None, (frozenset(), 0)
    for _ in range(50):
        ctl.note_outside(8, p.predicted_s)  # as much again as the step itself
    assert ctl.outside_s(8) == pytest.approx(p.predicted_s) and ctl.outside_s(64) == ctl.outside_s(8)
    q = ctl.plan(ids, [4] * 8, res, spec_res)
    assert q.plain_rate < p.plain_rate and q.spec_rate < p.spec_rate
    assert q.spec_rate / q.plain_rate > p.spec_rate / p.plain_rate


def test_plans_whose_rows_accept_less_than_expected_are_calibrated_down():
    """`Acceptance.calibration` (k_j): when the rows a plan drafts deep accept less than the plan's probabilities
    said, later plans price those positions lower and draft shallower."""
    ctl, res, spec_res = synthetic(read_s=1e-3)
    ctl.MIN_TRIALS = 0
    ids, lim = list(range(8)), [4] * 8
    ctl.acc.record(ids, [4] * 8, [3] * 8, [[0.9] * 4] * 8)
    p = ctl.plan(ids, lim, res, spec_res)
    assert p.kind == "spec" and max(p.gammas) >= 3 and p.probs.shape == (8, 4)
    for _ in range(30):  # the plan's rows accept only their first draft
        ctl.acc.record_plan(p.probs, p.gammas, [1] * 8)
    k = ctl.acc.calibration()
    assert k[0] >= 0.9 and k[1] < 0.5 and k[2] < 0.5
    ctl.coasting, ctl.spec_coasting = (frozenset(), 0), None
    q = ctl.plan(ids, lim, res, spec_res)
    assert sum(q.gammas or [0]) < sum(p.gammas)


def test_speculation_is_tried_once_per_batch_size_before_plain_defends_its_margin():
    """Cold start: until a speculative step is measured at a batch size, a drafter predicted close to the best is
    tried there once, and plain has no `switch_margin` to defend; once measured, the margin holds."""
    ctl, res, spec_res = synthetic(read_s=1e-5)  # speculation predicted ~3% faster than plain: inside the margin
    ids = list(range(8))
    ctl.acc.record(ids, [4] * 8, [2] * 8, [[0.9] * 4] * 8)
    first = ctl.plan(ids, [4] * 8, res, spec_res)
    assert first.kind == "spec" and first.reason == "explore"
    assert first.plain_rate < first.spec_rate < ctl.switch_margin * first.plain_rate
    ctl.realized.record("self", 8, first.predicted_s, first.predicted_s, ctl.steps)  # its step, measured
    ctl.last_arm, ctl.spec_coasting = "plain", None
    assert ctl.plan(ids, [4] * 8, res, spec_res).kind == "plain"  # measured here: plain keeps its margin
    ctl.coasting = (frozenset(), 0)
    wide = list(range(100, 132))
    again = ctl.plan(wide, [4] * 32, res, spec_res)  # a batch size not measured yet
    assert again.kind == "spec" and again.reason == "explore"


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


def test_any_call_is_reused_when_planning_costs_a_noticeable_share_of_the_step():
    """Coasting: a speculative call short of `coast_above` is planned afresh each step while planning is cheap
    against the step, and reused for the next steps once planning costs more than `coast_share` of it."""
    ctl, res, spec_res = synthetic(read_s=1.2e-4)  # speculation predicted ~18% faster than plain
    ids = list(range(8))
    ctl.acc.record(ids, [4] * 8, [2] * 8, [[0.9] * 4] * 8)
    ctl.realized.record("self", 8, 1.0, 1.0, 0)  # measured here: no first trial
    p = ctl.plan(ids, [4] * 8, res, spec_res)
    assert p.kind == "spec" and p.reason == "model" and p.spec_rate < ctl.coast_above * p.plain_rate
    assert ctl.spec_coasting is None
    ctl.plan_s = p.predicted_s  # planning as dear as the step itself: reused as long as allowed
    ctl.plan(ids, [4] * 8, res, spec_res)
    assert ctl.spec_coasting is not None and ctl.spec_coasting[2] == ctl.coast_max
    ctl.plan_s = 5 * ctl.coast_share * p.predicted_s  # 5 steps' share: one plan per ~5 steps
    q = ctl.plan(ids, [4] * 8, res, spec_res)
    assert ctl.spec_coasting[2] == math.ceil(ctl.plan_s / (ctl.coast_share * q.predicted_s)) in (5, 6)


def test_a_reused_calls_steps_learn_acceptance_always_and_step_time_one_in_a_stride():
    """Folding a step into the time model costs host time: on steps that reuse a call, it runs on one in
    `_learn_stride` of them while it costs more than `learn_share` of a step; every freshly planned step and every
    speculative step's acceptance is still learned."""
    from types import SimpleNamespace
    ctl, _, _ = synthetic(read_s=1e-3)
    calls = {"time": 0, "acc": 0, "cost": 0.004}

    def timed(*a):  # the time model's learning, said to cost 4 ms against 10 ms steps (learn_share 1%: stride 16)
        calls["time"] += 1
        ctl.learn_s = calls["cost"]
    ctl._learn_time = timed
    ctl._learn_acceptance = lambda *a: calls.__setitem__("acc", calls["acc"] + 1)
    ctl._expected_tokens = lambda *a: 1.0
    clock = SimpleNamespace(step_s=lambda: 0.01)  # a 10 ms step

    def step(reason):
        plan = SimpleNamespace(kind="spec", reason=reason, raw_rate=0.0)
        ctl.learn(SimpleNamespace(decision=plan), [], [], [], clock, 0)
    step("model")
    assert ctl._learn_stride(0.01) == ctl.coast_max == 16
    for _ in range(40):
        step("coast")
    assert calls["acc"] == 41 and calls["time"] == 1 + 40 // 16
    step("model")  # a fresh plan: always learned
    assert calls["time"] == 4
    calls["cost"], ctl.learn_skip = 1e-5, 0  # cheap learning: every step
    for _ in range(5):
        step("coast")
    assert calls["time"] == 9


def test_a_plain_call_is_reused_only_for_its_own_sequences():
    """A sequence's last step (nothing may be drafted) is plain without being reused: at batch 1 the next request
    would otherwise start with several plain steps; a reused plain call stops when another sequence joins."""
    ctl, res, spec_res = synthetic(read_s=5e-3)
    ctl.MIN_TRIALS = 0
    ctl.acc.record([0], [4], [3], [[0.9] * 4])
    ctl.plan_s = 1.0  # planning dear: any call with a choice in it is reused
    last = ctl.plan([0], [0], res, spec_res)  # sequence 0 at its last token
    assert last.kind == "plain" and last.spec_rate == 0.0 and ctl.coasting[1] == 0
    assert not ctl.coast([1])  # the next request plans its first step
    ctl.force = "plain"
    ctl.plan([1, 2], [4, 4], res, spec_res)
    assert ctl.coasting[1] > 0 and ctl.coast([1, 2]) and ctl.coast([2])  # reused while its sequences remain
    assert not ctl.coast([2, 3]) and ctl.coasting[1] == 0  # 3 joined: plan afresh


def test_a_new_sequence_on_a_reused_id_starts_with_nothing_measured(tiny_ckpt):
    """Finished sequences' ids are reused (every batch-1 request is sequence 0): the decoder admits the new one to
    the controller, which drops what it measured on the old one (its acceptance factor); a call being reused
    goes on (the workload's drafter and length)."""
    llm = auto_llm(tiny_ckpt("mixtral"))
    ctl = controller_of(llm)
    admitted, orig = [], ctl.admit

    def admit(seqs):
        admitted.append([s.seq_id for s in seqs])
        coasting = ctl.coasting
        orig(seqs)
        assert all(i not in a.seq for a in ctl.accs.values() for i in admitted[-1])
        assert ctl.coasting == coasting
    ctl.admit = admit
    ctl.force = "spec"  # every step drafts: the request's acceptance is measured on its id
    ps, sp = BATCHES["b1"]
    for _ in range(2):
        llm.generate(ps, sp)
        assert any(a.seq for a in ctl.accs.values())  # measured on this request's id by its end
    assert len(admitted) == 2 and admitted[1] == admitted[0]  # the second request came on the same id



def test_a_reused_call_follows_its_sequences_as_some_finish():
    """Spec coasting keeps each remaining sequence's drafter and length when others finished; a sequence that was
    not in the plan makes the next step plan afresh."""
    ctl, res, spec_res = synthetic(read_s=5e-3)  # a slow link: speculation

    class Lookup:  # a drafter that always has `limit` tokens
        def available(self, seqs, limits):
            return list(limits)

        def catchup(self, seqs):
            return [0] * len(seqs)

    class Seq:
        def __init__(self, sid):
            self.seq_id = sid
    ctl.decoder = type("D", (), {"drafters": {"self": Lookup()}})()
    ids = list(range(6))
    ctl.acc.record(ids, [4] * 6, [2] * 6, [[0.9] * 4] * 6)
    ctl.realized.record("self", 6, 1.0, 1.0, 0)
    ctl.plan_s = 1.0  # dear: the call is reused
    p = ctl.plan(ids, [4, 3, 2, 4, 1, 4], res, spec_res)
    assert p.kind == "spec" and ctl.spec_coasting is not None
    left = [Seq(i) for i in (1, 4, 5)]  # 0, 2 and 3 finished
    q = ctl.coast_spec(left, [4, 4, 4])
    assert q.reason == "coast" and q.gammas == [p.gammas[1], p.gammas[4], p.gammas[5]]
    assert q.drafter_of == [p.drafter_of[b] for b in (1, 4, 5)] and q.probs.shape[0] == 3
    assert ctl.coast_spec([Seq(1), Seq(9)], [4, 4]) is None and ctl.spec_coasting is None  # 9 joined


def test_near_a_tie_the_last_arm_is_kept_and_a_clear_winner_takes_over():
    """Hysteresis: the last step's arm is left only for one predicted `switch_margin` faster."""
    ctl, res, spec_res = synthetic(read_s=5e-3)
    ctl.MIN_TRIALS = 0
    ids, lim = list(range(8)), [4] * 8
    ctl.acc.record(ids, [4] * 8, [3] * 8, [[0.9] * 4] * 8)
    p = ctl.plan(ids, lim, res, spec_res)
    assert p.kind == "spec" and p.spec_rate > ctl.switch_margin * p.plain_rate and ctl.last_arm == "self"

    def plan_with(slowdown: float, last: str):
        """The plan at step 1 (same optimism each time) with the self arm's steps measuring `slowdown`× their
        prediction and `last` the previous step's arm."""
        ctl.realized.win.clear()
        for _ in range(Realized.WINDOW):
            ctl.realized.record("self", 8, slowdown, 1.0, 1)
        ctl.steps, ctl.last_arm, ctl.coasting, ctl.spec_coasting = 1, last, (frozenset(), 0), None
        return ctl.plan(ids, lim, res, spec_res)

    r = plan_with(1.0, "self")
    tie = r.spec_rate / (0.95 * r.plain_rate)  # plain predicted 5% faster than the speculation
    q = plan_with(tie, "self")
    assert q.plain_rate > q.spec_rate > q.plain_rate / ctl.switch_margin
    assert q.kind == "spec" and ctl.last_arm == "self"  # within the margin: speculation stays
    assert plan_with(tie, "plain").kind == "plain"  # had the last step been plain, it stays plain
    assert plan_with(3 * tie, "self").kind == "plain"  # a clear loss: plain takes over


def test_a_clear_speculative_call_is_reused_for_a_few_steps_of_the_same_sequences(tiny_ckpt):
    """Spec coasting: after a plan that chose speculation by `coast_above`, the next `coast_steps` steps of the
    same sequences reuse its drafters and lengths without planning (more while planning is dear); a sequence
    that joins makes the next step plan again."""
    path = tiny_ckpt("mixtral")
    llm = auto_llm(path)
    ctl = controller_of(llm)
    seen = []
    orig = ctl.choose

    def choose(*a, **k):
        seen.append("plan")
        return orig(*a, **k)
    ctl.choose = choose
    ctl.coast_above = 0.0  # every speculative call counts as clear
    ctl.MIN_TRIALS = 0
    for n in ctl.accs:  # every drafter measured good: the model speculates
        ctl.accs[n].record(list(range(100, 108)), [4] * 8, [4] * 8, [[0.9] * 4] * 8)
    ps, sp = BATCHES["b7"]
    assert [o.token_ids for o in llm.generate(ps, sp)] == reference(path, "b7")
    coasted = ctl.reasons.get("coast", 0)
    assert coasted > 0 and ctl.choices["spec"] > 0
    assert len(seen) + coasted == ctl.steps  # a coasted step never planned
    assert coasted <= ctl.coast_max * len(seen)  # coast_steps, more while planning is dear


def test_the_acceptance_memory_warms_a_new_engine_and_is_capped(tmp_path, monkeypatch):
    from specmoe.decoding.control.learning import Acceptance, ControllerMemory
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    a = Acceptance(4)
    for _ in range(300):  # 300 rows: 4 drafted, 2 accepted
        a.record([1], [4], [2], [[0.5] * 4])
    mem = ControllerMemory("k")
    mem.save({"eagle": a, "ngram": Acceptance(4)})  # a drafter that never drafted is not written
    assert set(json.loads(mem.path.read_text())["acceptance"]) == {"eagle"}
    b = {"eagle": Acceptance(4), "self": Acceptance(4)}
    assert ControllerMemory("k").warm(b) == ["eagle"]
    assert b["eagle"].position() == pytest.approx(a.position(), abs=0.02)
    assert b["eagle"].drafted[0] == pytest.approx(ControllerMemory.ROWS)  # worth ROWS rows, not 300
    assert b["self"].drafted.sum() == 0
    for _ in range(200):  # this run's own rows soon dominate
        b["eagle"].record([2], [4], [4], [[0.9] * 4])
    assert b["eagle"].position()[3] > 0.7
    assert ControllerMemory("other").warm(b) == []  # no file: the prior
    mem.path.write_text("{not json")
    assert ControllerMemory("k").warm({"eagle": Acceptance(4)}) == []  # unreadable: ignored


def test_auto_engines_share_the_acceptance_memory_unless_turned_off(tiny_ckpt, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = tiny_ckpt("mixtral")
    ps, sp = BATCHES["b7"]
    first = auto_llm(path)
    ctl = controller_of(first)
    assert ctl.warmed == []
    ctl.force, ctl.SAVE_EVERY = "spec", 1
    first.generate(ps, sp)
    assert ctl.memory.path.is_file()
    second = controller_of(auto_llm(path))
    assert second.warmed and second.acc.drafted[0] > 0
    assert second.stats()["acceptance_warmed_from_memory"] == second.warmed
    # the step-time corrections come along: refinement EMAs, ρ and each arm's measured / predicted time
    saved = json.loads(ctl.memory.path.read_text())
    assert json.loads(json.dumps(second.cost.state())) == saved["cost"] and saved["cost"]["time"]
    assert second.realized.state() == pytest.approx(saved["realized"]) and saved["realized"]
    off = controller_of(auto_llm(path, auto_memory=False))
    assert off.memory is None and off.warmed == [] and off.acc.drafted[0] == 0


def test_the_draft_routing_fraction_follows_the_observed_union():
    """ρ: a verification whose drafted tokens route like the pending one (union as of B + 0.3·drafted
    independent tokens) pulls ρ to 0.3, and the verification's expected union follows."""
    ctl, res, _ = synthetic(read_s=5e-3)
    cm = ctl.cost
    rng = np.random.default_rng(0)
    p = rng.dirichlet(np.ones(16), size=4) * 2  # [L, E], Σ_e p = top-k
    cm.routing.p = p.copy()
    B, drafted = 2, 8
    u_obs = float((1 - (1 - np.clip(p, 0, 1)) ** (B + 0.3 * drafted)).sum())
    before = cm.expected_union(cm.effective(B, [drafted]), res, "spec")[0].sum()
    for _ in range(80):
        cm.routing.last = (float(B + drafted), u_obs, p)
        cm.fold_union(B, drafted)
    assert cm.rho == pytest.approx(0.3, abs=0.02)
    after = cm.expected_union(cm.effective(B, [drafted]), res, "spec")[0].sum()
    assert after == pytest.approx(u_obs, rel=0.02) and before > after
    cm.routing.last = (float(B + drafted + 3), u_obs / 2, p)  # padding rows routed: not folded
    cm.fold_union(B, drafted)
    assert cm.rho == pytest.approx(0.3, abs=0.02)
