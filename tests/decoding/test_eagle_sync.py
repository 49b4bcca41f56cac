"""The eagle head reads a sequence's backlog (its prompt, the positions plain steps committed) apart from the draft
phase (`Drafter.sync`): a sequence decoded by plain steps alone never runs the head; a draft phase runs one entry
per row; a backlog is read by `idle` once it passes `EagleDrafter.BACKLOG`; the catch-up is timed with the
drafter's draft for the time model and left out of the measured rate `auto` chooses by. Greedy output stays
the plain greedy one throughout (demo model, fp32)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from specmoe import LLM
from specmoe.decoding.drafters.eagle import EagleDrafter
from specmoe.decoding.strategies.clock import PhaseClock
from specmoe.engine.auto import controller_of
from tests.decoding.eagle_cases import BATCHES
from tests.decoding.test_controller import synthetic


@pytest.fixture(scope="module")
def ref():
    ps, sp = BATCHES[7]
    return [o.token_ids for o in LLM(dtype="float32", threads=1).generate(ps, sp)]


def auto_llm(**kw):
    return LLM(dtype="float32", threads=1, decoding="auto", num_draft_tokens=3, offload="host", cache_experts=8,
               **kw)


def test_plain_steps_alone_never_run_the_head(ref):
    llm = auto_llm()
    controller_of(llm).force = "plain"
    ps, sp = BATCHES[7]
    assert [o.token_ids for o in llm.generate(ps, sp)] == ref
    st = llm.stats
    assert st["ar_steps"] > 0 and st["steps"] == 0
    assert st["eagle_head_forwards"] == 0 and st["eagle_catchup_entries"] == 0


def test_the_draft_phase_runs_one_entry_per_row_after_sync(ref, monkeypatch):
    """A fixed eagle configuration: a backlog longer than `SYNC_ABOVE` (the prompt, on the first step) is read by
    `sync`; the proposal's own first forward reads the rest with the pending position (what the last step
    accepted: at most γ + 1 entries a row), in one forward."""
    seen = {"sync": [], "draft": []}
    in_sync = []
    sync, catch_up = EagleDrafter.sync, EagleDrafter._catch_up

    def spy_sync(self, seqs):
        in_sync.append(True)
        try:
            return sync(self, seqs)
        finally:
            in_sync.pop()

    def spy_catch_up(self, seqs, upto):
        lens = [L - self.tracks[s.seq_id].head_len for s, L in zip(seqs, upto)]
        seen["sync" if in_sync else "draft"].append(lens)
        return catch_up(self, seqs, upto)
    monkeypatch.setattr(EagleDrafter, "sync", spy_sync)
    monkeypatch.setattr(EagleDrafter, "_catch_up", spy_catch_up)
    llm = LLM(dtype="float32", threads=1, decoding="specmoe", drafter="eagle", num_draft_tokens=3)
    ps, sp = BATCHES[7]
    assert [o.token_ids for o in llm.generate(ps, sp)] == ref
    assert seen["sync"] and min(min(lens) for lens in seen["sync"]) > EagleDrafter.SYNC_ABOVE  # the prompts
    assert seen["draft"] and all(1 <= n <= 3 + 1 for lens in seen["draft"] for n in lens)
    assert any(n > 1 for lens in seen["draft"] for n in lens)  # accepted drafts, read with the pending position
    assert len(seen["draft"]) == llm.stats["steps"]  # one catch-up forward a step
    assert llm.stats["step_breakdown"]["draft_nonexpert_s"] > 0


def test_a_long_backlog_is_read_while_idle(ref, monkeypatch):
    """Plain steps first (scheduled), then speculation: no sequence's unread features pass `BACKLOG` positions
    after any plain step, and the head, once it drafts, drafts from the features it read while idle."""
    monkeypatch.setattr(EagleDrafter, "BACKLOG", 4)
    worst, idle = [], EagleDrafter.idle

    def spy_idle(self):
        idle(self)
        L = self.runner.cache.lengths
        worst.append(max((L[t.seq.slot] - 1 - t.head_len for t in self.tracks.values()), default=0))
    monkeypatch.setattr(EagleDrafter, "idle", spy_idle)
    llm = auto_llm(drafter="eagle")
    controller_of(llm).schedule = lambda i: "plain" if i < 12 else "spec"
    ps, sp = BATCHES[7]
    assert [o.token_ids for o in llm.generate(ps, sp)] == ref
    st = llm.stats
    assert len(worst) >= 12 and max(worst) <= 4
    assert st["eagle_catchup_entries"] > 0 and st["drafters"]["eagle"]["rows"] > 0
    assert st["accepted_tokens"] > 0


def test_a_catch_up_is_timed_with_the_draft_but_left_out_of_the_measured_rate():
    ctl, _, _ = synthetic(read_s=1e-3)
    got = {}
    ctl.measured.record = lambda arm, B, tokens, seconds, *a, **k: got.setdefault("rate_s", seconds)
    ctl._learn_time = lambda splan, plan, seqs, depths, clock, step_bytes, measured, *a: got.setdefault("time_s",
                                                                                                        measured)
    ctl._learn_acceptance = lambda *a: None
    ctl._expected_tokens = lambda *a: 1.0
    clock = PhaseClock(runner=None, spans={"catchup": (0.05, 0.0, 0.0), "draft": (0.002, 0.0, 0.0),
                                           "verify": (0.01, 0.0, 0.0), "accept": (0.001, 0.0, 0.0)})
    plan = SimpleNamespace(kind="spec", reason="model", raw_rate=0.0, arm="eagle-g2", width=1)
    ctl.learn(SimpleNamespace(decision=plan, drafter_of=[]), [], [], [], clock, 0)
    assert got["rate_s"] == pytest.approx(0.013) and got["time_s"] == pytest.approx(0.063)
