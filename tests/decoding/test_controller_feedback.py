"""decoding="auto": what the controller learns from measured steps (`control/feedback.py`, `refinement.py`,
`learning.py`): the cost model's calibration and online refinements, each arm's realized correction, the step cost
outside the model, per-position acceptance calibration, the learning stride on reused steps, the acceptance memory
and the draft routing fraction."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from specmoe.decoding.control import costmodel as cmod
from specmoe.decoding.control.learning import Realized
from specmoe.engine.auto import controller_of

from tests.decoding.test_controller import auto_llm, synthetic
from tests.decoding.test_specmoe import BATCHES


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


def test_an_arm_whose_steps_measure_slower_than_predicted_is_priced_so_until_it_fades():
    """The measured / predicted step time of an arm (here the self draft's speculation) scales its predicted
    rate once it has Realized.MIN_STEPS steps; a correction not refreshed fades back to the model's."""
    ctl, res, spec_res = synthetic(read_s=5e-3)
    ids, lim = list(range(8)), [4] * 8
    ctl.acc.record(ids, [4] * 8, [3] * 8, [[0.9] * 4] * 8)
    p = ctl.plan(ids, lim, res, spec_res)
    assert p.kind == "spec" and p.arm == "self"
    for k in range(Realized.MIN_STEPS):
        for arm in [a for a in ctl.arm_rates if a != "plain"]:  # "self" and "self-g2" (short drafts)
            ctl.realized.record(arm, 8, 6 * p.predicted_s, p.predicted_s, ctl.steps)  # 6x slower than modelled
        ctl.realized.record("plain", 8, 1.0, 1.0, ctl.steps)
    assert ctl.realized.slowdown("self", 8, ctl.steps) == pytest.approx(6.0)
    ctl.coasting = (frozenset(), 0)
    q = ctl.plan(ids, lim, res, spec_res)
    assert q.kind == "plain" and q.spec_rate == pytest.approx(p.spec_rate / 6, rel=0.05)
    ctl.steps += 20 * int(Realized.FADE)  # long unused: back to the model's price
    ctl.coasting = (frozenset(), 0)
    assert ctl.plan(ids, lim, res, spec_res).kind == "spec"


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
    ctl.measured.min_steps = 0
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
    clock = SimpleNamespace(step_s=lambda: 0.01, priced_s=lambda: 0.01, wall=lambda phase: 0.0,
                            traffic=lambda: (0.0, 0))  # a 10 ms step

    def step(reason):
        plan = SimpleNamespace(kind="spec", reason=reason, raw_rate=0.0, arm="self", width=1)
        ctl.learn(SimpleNamespace(decision=plan, drafter_of=[]), [], [], [], clock, 0)
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
    assert b["eagle"].position() == pytest.approx(a.position(), abs=0.03)  # the prior weighs 2 rows against 48 at each depth
    assert b["eagle"].reach[0, 0] == pytest.approx(ControllerMemory.ROWS)  # worth ROWS rows, not 300
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
    ctl.force, ctl.SAVE_EVERY, ctl.SAVE_S = "spec", 1, 0.0
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


def test_acceptance_per_position_is_the_product_of_the_chain_conditionals():
    """P_j is a chain's: draft j is accepted only if every draft before it was, so P_j is the product of the node
    table's rank-0 conditionals (node accepted | parent accepted) and never rises with j, even when the rows that
    drafted deep accepted more than the rows that drafted one token. Worked out: 10 rows drafted 1 token and lost
    it, 5 rows drafted 4 and kept them all (prior 0.6, weight 2)."""
    from specmoe.decoding.control.learning import Acceptance
    a = Acceptance(4, prior=0.6, prior_weight=2.0, decay=0.0)
    a.record(list(range(15)), [1] * 10 + [4] * 5, [0] * 10 + [4] * 5, [[0.5]] * 10 + [[0.5] * 4] * 5)
    q = [(5 + 2 * 0.6) / ((15 if j == 0 else 5) + 2) for j in range(4)]  # (accepted + w·prior) / (reached + w)
    assert q[1] > q[0]  # the deep rows' conditionals are higher ...
    assert a.position().tolist() == pytest.approx(list(np.cumprod(q)))  # ... the chain's P_j still falls
    assert a.node_prob(1, 0) == pytest.approx(q[0]) and a.node_prob(2, 0) == pytest.approx(q[1])
    assert a.node_prob(1, 1) == pytest.approx(0.6)  # a rank never drafted: the prior
