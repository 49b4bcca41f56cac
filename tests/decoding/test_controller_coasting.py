"""decoding="auto": reusing a call without planning (`control/coasting.py`): when it is reused, for which
sequences, how long, and what a reused call does as its sequences finish or are replaced."""
from __future__ import annotations

import math

from specmoe.decoding.control.measured import Pick
from specmoe.decoding.control.view import StepView
from specmoe.engine.auto import controller_of

from tests.decoding.test_controller import auto_llm, synthetic
from tests.decoding.test_specmoe import BATCHES, reference


def test_any_call_is_reused_when_planning_costs_a_noticeable_share_of_the_step():
    """Coasting: a speculative call short of `coast_above` is planned afresh each step while planning is cheap
    against the step, and reused for the next steps once planning costs more than `coast_share` of it."""
    ctl, res, spec_res = synthetic(read_s=1.2e-4)  # speculation predicted ~18% faster than plain
    ids = list(range(8))
    ctl.acc.record(ids, [4] * 8, [2] * 8, [[0.9] * 4] * 8)
    ctl.measured.min_steps = 0  # no trials: the model's choice
    p = ctl.plan(ids, [4] * 8, res, spec_res)
    assert p.kind == "spec" and p.reason == "model" and p.spec_rate < ctl.coast_above * p.plain_rate
    assert ctl.spec_coasting is None
    ctl.plan_s = p.predicted_s  # planning as dear as the step itself: reused as long as allowed
    ctl.plan(ids, [4] * 8, res, spec_res)
    assert ctl.spec_coasting is not None and ctl.spec_coasting[2] == ctl.coast_max
    ctl.plan_s = 5 * ctl.coast_share * p.predicted_s  # 5 steps' share: one plan per ~5 steps
    q = ctl.plan(ids, [4] * 8, res, spec_res)
    assert ctl.spec_coasting[2] == math.ceil(ctl.plan_s / (ctl.coast_share * q.predicted_s)) in (5, 6)


def test_a_plain_call_is_reused_only_for_its_own_sequences():
    """A sequence's last step (nothing may be drafted) is plain without being reused: at batch 1 the next request
    would otherwise start with several plain steps; a reused plain call stops when another sequence joins."""
    ctl, res, spec_res = synthetic(read_s=5e-3)
    ctl.measured.min_steps = 0
    ctl.acc.record([0], [4], [3], [[0.9] * 4])
    ctl.plan_s = 1.0  # planning dear: any call with a choice in it is reused
    last = ctl.plan([0], [0], res, spec_res)  # sequence 0 at its last token
    assert last.kind == "plain" and last.spec_rate == 0.0 and ctl.coasting[1] == 0
    assert not ctl.coast([1])  # the next request plans its first step
    ctl.force = "plain"
    ctl.plan([1, 2], [4, 4], res, spec_res)
    assert ctl.coasting[1] > 0 and ctl.coast([1, 2]) and ctl.coast([2])  # reused while its sequences remain
    assert not ctl.coast([2, 3]) and ctl.coasting[1] == 0  # 3 joined: plan afresh


def test_a_reused_call_follows_its_sequences_as_some_finish():
    """Spec coasting keeps each remaining sequence's drafter and length when others finished; a sequence that was
    not in the plan makes the next step plan afresh."""
    ctl, res, spec_res = synthetic(read_s=5e-3)  # a slow link: speculation

    class Seq:
        def __init__(self, sid):
            self.seq_id = sid
            self.output_ids = [0] * 16

    def view(seqs, limits):  # a drafter that always has `limit` tokens
        return StepView(seqs, limits, ("self",), lambda n: list(limits), lambda n: [0] * len(seqs), lambda layer: [],
                        lambda: {})
    ids = list(range(6))
    ctl.acc.record(ids, [4] * 6, [2] * 6, [[0.9] * 4] * 6)
    ctl.realized.record("self", 6, 1.0, 1.0, 0)
    ctl.plan_s = 1.0  # dear: the call is reused
    p = ctl.plan(ids, [4, 3, 2, 4, 1, 4], res, spec_res)
    assert p.kind == "spec" and ctl.spec_coasting is not None
    left = [Seq(i) for i in (1, 4, 5)]  # 0, 2 and 3 finished
    q = ctl.coast_spec(view(left, [4, 4, 4]))
    assert q.reason == "coast" and q.gammas == [p.gammas[1], p.gammas[4], p.gammas[5]]
    assert q.drafter_of == [p.drafter_of[b] for b in (1, 4, 5)] and q.probs.shape[0] == 3
    assert ctl.coast_spec(view([Seq(1), Seq(9)], [4, 4])) is None and ctl.spec_coasting is None  # 9 joined


def test_a_clear_speculative_call_is_reused_for_a_few_steps_of_the_same_sequences(tiny_ckpt):
    """Spec coasting: after a plan that chose speculation by `coast_above`, the next `coast_steps` steps of the
    same sequences reuse its drafters and lengths without planning (more while planning is dear); a sequence
    that joins makes the next step plan again."""
    path = tiny_ckpt("mixtral")
    llm = auto_llm(path, auto_memory=False)  # not what an earlier engine measured: the model's choice
    ctl = controller_of(llm)
    seen = []
    orig = ctl.choose

    def choose(*a, **k):
        seen.append("plan")
        return orig(*a, **k)
    ctl.choose = choose
    ctl.coast_above = 0.0  # every speculative call counts as clear
    # speculation measured faster (whatever this machine measures): the best speculative arm, decided
    ctl.measured.pick = lambda arms, B, young=False: Pick(
        max(arms[1:], key=lambda a: a.predicted).name if arms[1:] else "plain", "measured")
    ps, sp = BATCHES["b7"]
    assert [o.token_ids for o in llm.generate(ps, sp)] == reference(path, "b7")
    coasted = ctl.reasons.get("coast", 0)
    assert coasted > 0 and ctl.choices["spec"] > 0
    assert len(seen) + coasted == ctl.steps  # a coasted step never planned
    assert coasted <= ctl.coast_max * len(seen)  # coast_steps, more while planning is dear


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


def test_a_measured_fixed_configuration_is_reused_longest_and_its_reused_steps_run_no_draft_hook():
    """A fixed configuration ("self-g4") chosen on measured rates has nothing that goes stale: it is reused for
    `coast_max` steps, however cheap planning is, and its reused steps draft with no hook (nothing to stop); the
    model-planned arm of the same drafter, chosen the same way, keeps the short reuse and its hook."""
    from types import SimpleNamespace

    from specmoe.decoding.control.plan import StepPlan
    ctl, res, spec_res = synthetic(read_s=1.2e-4)
    ids = list(range(8))
    ctl.acc.record(ids, [4] * 8, [2] * 8, [[0.9] * 4] * 8)

    def Seq(sid):
        return SimpleNamespace(seq_id=sid, params=SimpleNamespace(greedy=True), output_ids=[0] * 16)

    def view(seqs, limits):
        return StepView(seqs, limits, (ctl.names[0],), lambda n: list(limits), lambda n: [0] * len(seqs),
                        lambda layer: [], lambda: {})
    ctl.plan_s = None  # planning cheap: no reuse for its cost
    name = ctl.names[0]
    for arm, reuse in ((f"{name}-g4", ctl.coast_max), (name, None)):
        ctl.spec_coasting = None
        ctl.measured.pick = lambda arms, B, young=False, arm=arm: Pick(arm, "measured")
        p = ctl.plan(ids, [4] * 8, res, spec_res)
        assert p.kind == "spec" and p.arm == arm
        if reuse is None:  # not a clear win here: planned afresh next step
            assert ctl.spec_coasting is None or ctl.spec_coasting[2] < ctl.coast_max
            continue
        assert ctl.spec_coasting is not None and ctl.spec_coasting[2] == reuse
        seqs = [Seq(i) for i in ids]
        q = ctl.coast_spec(view(seqs, [4] * 8))
        assert q is not None and q.reason == "coast"
        splan = StepPlan(q.drafter_of, q.gammas, q)
        assert ctl.stopper(splan, name, ids, seqs, list(q.gammas)) is None
        fresh = StepPlan(p.drafter_of, p.gammas, p)  # the freshly planned step still reads confidences
        assert ctl.stopper(fresh, name, ids, seqs, list(p.gammas)) is not None


class _Seq:
    def __init__(self, sid):
        self.seq_id = sid
        self.output_ids = [0] * 16  # past a request's first tokens (`MeasuredArms.YOUNG`)


def _view(ids, limits):  # a drafter "self" that always has `limit` tokens; nothing resident
    return StepView([_Seq(i) for i in ids], limits, ("self",), lambda n: list(limits), lambda n: [0] * len(ids),
                    lambda layer: [], lambda: {})


def test_a_measured_fixed_configuration_is_reused_by_sequences_joining_in_its_batch_bucket():
    """A measured fixed configuration ("self-g2") has nothing per row: the next request at batch 1 reuses its call
    (no plan for its first step), rows at their last token take one plain step without planning and keep the call;
    a batch that changes bucket plans afresh, and so does a per-row plan when a sequence joins."""
    ctl, res, spec_res = synthetic(read_s=5e-3)
    ctl.acc.record([0], [4], [2], [[0.9] * 4])
    ctl.measured.pick = lambda arms, B, young=False: Pick("self-g2", "measured")
    p = ctl.plan([0], [4], res, spec_res)
    assert p.arm == "self-g2" and p.gammas == [2] and ctl.spec_coasting[2] == ctl.coast_max
    fresh = []
    ctl._plan_fresh = lambda view: fresh.append(view) or p
    last = ctl.plan_step(_view([0], [0]))  # sequence 0 at its last token: nothing may be drafted
    assert last.plain and last.decision is None and not fresh and ctl.spec_coasting is not None
    q = ctl.plan_step(_view([5], [4]))  # the next request joins the reused call
    assert not fresh and q.decision.reason == "coast" and q.drafter_of == ["self"] and q.gammas == [2]
    assert ctl.spec_coasting[0] == (5,)
    assert ctl.coast_spec(_view([5, 6, 7], [4, 4, 4])) is None and ctl.spec_coasting is None  # bucket 1 -> 4
    # per-row lengths: a joining row plans afresh
    ctl.measured.pick = lambda arms, B, young=False: Pick("self", "measured")
    ctl.plan_s = 1.0
    r = ctl.plan([0], [4], res, spec_res)
    assert r.arm == "self" and ctl.spec_coasting is not None
    assert ctl.coast_spec(_view([5], [4])) is None and ctl.spec_coasting is None


def test_a_measured_plain_call_is_reused_by_sequences_joining_in_its_batch_bucket():
    ctl, res, spec_res = synthetic(read_s=5e-3)
    ctl.acc.record([0], [4], [2], [[0.9] * 4])
    ctl.measured.pick = lambda arms, B, young=False: Pick("plain", "measured")
    p = ctl.plan([0, 1], [4, 4], res, spec_res)
    assert p.kind == "plain" and ctl.coasting[1] == ctl.coast_max and ctl.plain_rejoins
    assert ctl.coast([1, 2])  # 2 joined, still 2 sequences: bucket 2
    assert not ctl.coast([1, 2, 3])  # bucket 4: plan afresh
    ctl.force = "plain"  # a forced plain call: its own sequences only
    ctl.plan([0, 1], [4, 4], res, spec_res)
    assert not ctl.plain_rejoins and ctl.coast([0, 1]) and not ctl.coast([1, 2])


def test_a_measured_call_is_reused_longer_once_nothing_is_left_to_explore():
    """`coast_max` steps while the bandit still has arms to try at this bucket (trials start at fresh plans),
    `coast_settled` once its last pick found none."""
    ctl, res, spec_res = synthetic(read_s=5e-3)
    ctl.acc.record([0], [4], [2], [[0.9] * 4])
    m = ctl.measured
    for arm in ("plain", "self", "self-g2", "self-g4"):  # every arm measured at bucket 1, self-g2 clearly fastest
        for i in range(3 * m.min_steps):
            m.record(arm, 1, 3.0 if arm == "self-g2" else 1.5, 0.01, i)
    m.current[1], m.steps = "self-g2", 1000
    for _ in range(m.SETTLE):
        m.recent.append(1)
    p = ctl.plan([0], [4], res, spec_res)
    assert p.arm == "self-g2" and p.reason == "measured" and m.settled(1)
    assert ctl.spec_coasting[2] == ctl.coast_settled > ctl.coast_max
    m.win.pop(("self-g4", 1))  # an arm not measured: a trial is due at the next fresh plan
    ctl.spec_coasting = None
    ctl.plan([0], [4], res, spec_res)
    assert not m.settled(1)


def test_a_measured_lookup_configuration_without_a_proposal_plans_its_step_afresh():
    """A fixed configuration of a lookup drafter whose rows have no proposal now (their limits > 0): the step is
    planned afresh (another arm may draft it), not reused as a plain step."""
    ctl, res, spec_res = synthetic(read_s=5e-3)
    ctl.acc.record([0], [4], [2], [[0.9] * 4])
    ctl.measured.pick = lambda arms, B, young=False: Pick("self-g2", "measured")
    ctl.plan([0], [4], res, spec_res)
    nothing = StepView([_Seq(0)], [4], ("self",), lambda n: [0], lambda n: [0], lambda layer: [], lambda: {})
    assert ctl.coast_spec(nothing) is None and ctl.spec_coasting is None and not ctl.coast([0])


def test_a_reused_fixed_configuration_drafts_its_length_not_the_one_capped_when_it_was_planned():
    """A fixed configuration planned at a step where its rows could draft less (a request's last tokens, a lookup's
    short proposal) drafts its full length on the next steps where it can: a reused "self-g2" planned with one
    token left drafts 2, also for the next request under the same (reused) sequence id; a reused per-row call ends
    when its id is admitted again (its lengths were another sequence's)."""
    ctl, res, spec_res = synthetic(read_s=5e-3)
    ctl.acc.record([0], [4], [2], [[0.9] * 4])
    ctl.measured.pick = lambda arms, B, young=False: Pick("self-g2", "measured")
    p = ctl.plan([0], [1], res, spec_res)  # one token left to draft
    assert p.arm == "self-g2" and p.gammas == [1]
    ctl.admit([_Seq(0)])  # the next request, under id 0
    q = ctl.coast_spec(_view([0], [4]))
    assert q.reason == "coast" and q.gammas == [2]
    ctl.measured.pick = lambda arms, B, young=False: Pick("self", "measured")
    ctl.plan_s, ctl.spec_coasting = 1.0, None
    r = ctl.plan([0], [1], res, spec_res)
    assert r.arm == "self" and ctl.spec_coasting is not None
    ctl.admit([_Seq(0)])
    assert ctl.spec_coasting is None


def test_a_drift_ends_the_reused_calls():
    """When the exploited arm's rate moves (`MeasuredArms.drifts`), the next step plans afresh (the arms flagged
    stale are re-measured from a fresh plan), whichever call was being reused."""
    ctl, res, spec_res = synthetic(read_s=5e-3)
    ctl.acc.record([0], [4], [2], [[0.9] * 4])
    ctl.measured.pick = lambda arms, B, young=False: Pick("self-g2", "measured")
    ctl.plan([0], [4], res, spec_res)
    assert ctl.coast_spec(_view([0], [4])) is not None
    ctl.measured.drifts += 1
    assert ctl.coast_spec(_view([0], [4])) is None and ctl.spec_coasting is None
    ctl.measured.pick = lambda arms, B, young=False: Pick("plain", "measured")
    ctl.plan([0], [4], res, spec_res)
    assert ctl.coast([0])
    ctl.measured.drifts += 1
    assert not ctl.coast([0])


def test_a_reused_step_that_repeats_the_last_one_returns_its_plan_and_prices_drafts_only_when_learned():
    """The steps of a reused call whose rows, lengths and drafters repeat the last reused step's get that step's Plan
    object (no copy); a step that differs (a row capped at its last tokens, a row that finished) gets its own. The
    drafters' catch-up (what `_learn_time` prices drafts with) is read only on a step whose time will be learned."""
    ctl, res, spec_res = synthetic(read_s=5e-3)
    ctl.acc.record([0, 1], [4, 4], [2, 2], [[0.9] * 4] * 2)
    ctl.measured.pick = lambda arms, B, young=False: Pick("self-g2", "measured")
    ctl.plan([0, 1], [4, 4], res, spec_res)
    reads = []
    view = lambda limits, ids=(0, 1): StepView(  # noqa: E731
        [_Seq(i) for i in ids], limits, ("self",), lambda n: list(limits), lambda n: reads.append(n) or [1] * len(ids),
        lambda layer: [], lambda: {})
    ctl.learn_skip = 3  # the next reused steps' times are not learned
    a = ctl.coast_spec(view([4, 4]))
    b = ctl.coast_spec(view([4, 4]))
    assert a.reason == b.reason == "coast" and a.gammas == [2, 2] and b is a and not reads
    c = ctl.coast_spec(view([4, 1]))  # row 1 one token from its end: drafts 1
    assert c is not a and c.gammas == [2, 1] and a.gammas == [2, 2]
    d = ctl.coast_spec(view([4], ids=(0,)))  # row 1 finished
    assert d is not c and d.gammas == [2] and d.drafter_of == ["self"]
    ctl.learn_skip = 0  # this step's time is learned: its drafts are priced on the drafters' catch-up now
    e = ctl.coast_spec(view([4], ids=(0,)))
    assert e is d and reads == ["self"] and ctl.catchup["self"].tolist() == [1]


def test_a_trial_of_a_fixed_configuration_reuses_its_first_steps_call_and_counts_as_exploration():
    """An exploration burst of a fixed configuration plans its first step and reuses that call for the rest of the
    burst (a fresh plan on each trial step cost it ~15% at batch 1): those steps run the trial's arm, count as
    exploration steps, and the burst ends where the bandit's would; then the next step plans afresh."""
    ctl, res, spec_res = synthetic(read_s=5e-3)
    ctl.acc.record([0], [4], [2], [[0.9] * 4])
    m = ctl.measured
    for arm in ("plain", "self", "self-g2"):  # self-g4 (the exploited drafter's other length) not measured yet
        for i in range(3 * m.min_steps):
            m.record(arm, 1, 3.0 if arm == "self-g2" else 1.5, 0.01, i)
    m.current[1], m.steps = "self-g2", 10
    p = ctl.plan([0], [4], res, spec_res)
    assert p.reason == "explore" and p.arm == "self-g4" and p.gammas == [4]
    left = m.burst.left
    assert left == m.need(1) and ctl.spec_coasting[2] == left
    fresh = []
    real = ctl._plan_fresh
    ctl._plan_fresh = lambda view: fresh.append(1) or real(view)
    explored = m.explored_all
    for k in range(left):
        q = ctl.plan_step(_view([0], [4]))
        assert q.decision.arm == "self-g4" and q.decision.reason == "coast" and q.gammas == [4]
    assert not fresh and m.explored_all == explored + left and m.burst.left == 0
    assert ctl.reasons["explore"] == 1 + left and m.chosen["self-g4"] == 1 + left
    ctl.plan_step(_view([0], [4]))  # the burst is over: planned afresh
    assert fresh == [1]


def test_a_trial_of_plain_reuses_its_first_steps_call():
    ctl, res, spec_res = synthetic(read_s=5e-3)
    ctl.acc.record([0], [4], [2], [[0.9] * 4])
    m = ctl.measured
    for arm in ("self", "self-g2", "self-g4"):  # plain (the baseline) not measured: tried first
        for i in range(3 * m.min_steps):
            m.record(arm, 1, 3.0 if arm == "self-g2" else 1.5, 0.01, i)
    m.current[1], m.steps = "self-g2", 10
    p = ctl.plan([0], [4], res, spec_res)
    assert p.kind == "plain" and p.reason == "explore" and ctl.coasting[1] == m.burst.left == m.need(1)
    explored = m.explored_all
    assert all(ctl.coast([0]) for _ in range(m.need(1))) and not ctl.coast([0])
    assert m.explored_all == explored + m.need(1) and m.chosen["plain"] == 1 + m.need(1)


def test_a_trials_reused_call_ends_when_the_batch_leaves_its_bucket():
    """A trial's call is reused only while its burst runs at its bucket: rows of a batch of 4 finishing into batch 2
    end it (the trial's arm does not run on through the batch's tail), and the next step plans afresh."""
    ctl, res, spec_res = synthetic(read_s=5e-3)
    ctl.acc.record([0, 1, 2, 3], [4] * 4, [2] * 4, [[0.9] * 4] * 4)
    m = ctl.measured
    for arm in ("plain", "self", "self-g2"):
        for i in range(3 * m.min_steps):
            m.record(arm, 4, 12.0 if arm == "self-g2" else 6.0, 0.01, i)
    m.current[4], m.steps = "self-g2", 10
    for _ in range(m.SETTLE):
        m.recent.append(4)
    p = ctl.plan([0, 1, 2, 3], [4] * 4, res, spec_res)
    assert p.reason == "explore" and p.arm == "self-g4" and ctl.spec_coasting[2] == m.burst.left > 1
    q = ctl.coast_spec(_view([0, 1, 2], [4, 4, 4]))  # one row finished: still bucket 4
    assert q is not None and q.arm == "self-g4" and m.burst.left >= 1
    assert ctl.coast_spec(_view([0, 1], [4, 4])) is None and ctl.spec_coasting is None  # bucket 2: the call ends
