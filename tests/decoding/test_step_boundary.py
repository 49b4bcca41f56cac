"""The typed step boundary (`strategies/protocol.py`): the engine tells a strategy which sequences are new and which
left (`StepInput`), a step answers `StepOutput` and its counters are a `StrategyStats`; there is one plain step
(`autoregressive.plain_tokens`, which auto's plain steps run too); the controller is given a `StepView` and holds
no reference to the decoder, its runner, its store or a drafter's internals."""
from __future__ import annotations

import ast
import inspect
from pathlib import Path

from specmoe import LLM, SamplingParams
from specmoe.decoding.control import controller as controller_mod
from specmoe.decoding.control.controller import Controller
from specmoe.decoding.strategies import autoregressive, speculative
from specmoe.decoding.strategies.autoregressive import AutoregressiveDecoder
from specmoe.decoding.strategies.protocol import StepInput, StepOutput, StrategyStats
from specmoe.decoding.strategies.speculative import SpeculativeDecoder
from specmoe.engine.auto import controller_of

from tests.decoding.test_controller import auto_llm
from tests.decoding.test_specmoe import BATCHES, reference

CONTROL = Path(controller_mod.__file__).parent


def record_steps(monkeypatch, cls) -> list[StepInput]:
    seen = []
    real = cls.step

    def step(self, inp):
        assert isinstance(inp, StepInput)
        seen.append(inp)
        out = real(self, inp)
        assert isinstance(out, StepOutput) and set(out.tokens) == {s.seq_id for s in inp.seqs}
        return out
    monkeypatch.setattr(cls, "step", step)
    return seen


def test_step_input_names_new_and_finished_sequences(tiny_ckpt, monkeypatch):
    """Three requests with 3, 6 and 9 tokens: each is new in exactly its first decode step, and each one that
    finishes is named finished in the next step after it left (never while still active)."""
    path = tiny_ckpt("mixtral")
    for cls, kw in ((AutoregressiveDecoder, dict(decoding="ar")), (SpeculativeDecoder, dict(decoding="auto"))):
        seen = record_steps(monkeypatch, cls)
        llm = LLM(path, **kw)
        sp = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (3, 6, 9)]
        llm.generate([[5, 6, 7], [8, 9, 10, 11], [12, 13]], sp)
        first = {}
        for i, inp in enumerate(seen):
            for s in inp.seqs:
                first.setdefault(s.seq_id, i)
            assert not {s.seq_id for s in inp.seqs} & set(inp.finished)
        assert {s.seq_id for inp in seen for s in inp.new} == set(first)
        for i, inp in enumerate(seen):
            assert sorted(s.seq_id for s in inp.new) == sorted(k for k, v in first.items() if v == i), cls
        left = [k for inp in seen for k in inp.finished]
        assert len(left) == len(set(left)) >= 2 and set(left) < set(first), cls  # the last leaves after the last step
        monkeypatch.undo()


def test_a_new_sequence_is_admitted_from_the_step_input(tiny_ckpt, monkeypatch):
    """The sequence a step's input names as new is admitted to the controller once, at its first step."""
    llm = auto_llm(tiny_ckpt("mixtral"))
    ctl = controller_of(llm)
    admitted = []
    real = ctl.admit
    monkeypatch.setattr(ctl, "admit", lambda seqs: (admitted.append([s.seq_id for s in seqs]), real(seqs))[1])
    ps, sp = BATCHES["b1"]
    path = tiny_ckpt("mixtral")
    assert [o.token_ids for o in llm.generate(ps, sp)] == reference(path, "b1")
    assert admitted == [[0]]  # once, at its first step


def test_the_plain_step_is_the_autoregressive_one(tiny_ckpt, monkeypatch):
    """AR steps and auto's plain steps both run `autoregressive.plain_tokens` (one plain step in the code base)."""
    calls = {"n": 0}
    real = autoregressive.plain_tokens

    def counted(*a, **k):
        calls["n"] += 1
        return real(*a, **k)
    monkeypatch.setattr(autoregressive, "plain_tokens", counted)
    monkeypatch.setattr(speculative, "plain_tokens", counted)
    path = tiny_ckpt("mixtral")
    ps, sp = BATCHES["b1"]
    ar = LLM(path, decoding="ar")
    ar.generate(ps, sp)
    assert calls["n"] == ar.stats["decode_steps"] > 0
    calls["n"] = 0
    auto = auto_llm(path)
    controller_of(auto).force = "plain"
    auto.generate(ps, sp)
    assert calls["n"] == auto.stats["ar_steps"] == auto.stats["decode_steps"] > 0


def test_strategies_answer_typed_stats(tiny_ckpt, monkeypatch):
    """Both strategies' `stats()` are a `StrategyStats`; the engine shows its section and its phases."""
    from specmoe.engine import llm as llm_mod
    made = []
    make = llm_mod.make_strategy
    monkeypatch.setattr(llm_mod, "make_strategy", lambda *a, **k: made.append(make(*a, **k)) or made[-1])
    path = tiny_ckpt("mixtral")
    for decoding in ("ar", "specmoe"):
        llm = LLM(path, decoding=decoding)
        llm.generate(*BATCHES["b1"])
        st = made[-1].stats()
        assert isinstance(st, StrategyStats) and st.decoding == decoding
        assert llm.stats["decoding"] == decoding and set(st.step_breakdown) <= set(llm.stats["step_breakdown"])


def test_the_controller_reads_no_decoder_runner_store_or_drafter_internals():
    """No module of control/ names the decoder, a runner's provider or a drafter's expert set; the controller
    keeps no attribute that is a decoder."""
    for path in CONTROL.glob("*.py"):
        tree = ast.parse(path.read_text())
        attrs = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        assert not attrs & {"decoder", "provider", "runner", "experts", "drafters"}, (path.name, attrs)
    ctl = Controller.__init__
    assert "decoder" not in inspect.signature(ctl).parameters


def test_choose_and_the_speculative_step_read_in_under_40_lines():
    for f in (Controller.choose, SpeculativeDecoder.step):
        n = len(inspect.getsource(f).splitlines())
        assert n < 40, (f.__qualname__, n)


def test_prefill_sits_beside_the_runner_and_no_strategy_defines_one():
    """The engine core's prefill and the model runner are one package (`decoding/runtime`), the layer the core calls;
    no strategy module defines or imports a prefill."""
    from specmoe.decoding.runtime import prefill as prefill_mod, runner as runner_mod
    from specmoe.engine import core
    assert Path(prefill_mod.__file__).parent == Path(runner_mod.__file__).parent
    assert core.prefill is prefill_mod.prefill and core.ModelRunner is runner_mod.ModelRunner
    strategies = Path(speculative.__file__).parent
    for f in strategies.glob("*.py"):
        names = {n.name for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, ast.FunctionDef)}
        names |= {a.name for n in ast.walk(ast.parse(f.read_text())) if isinstance(n, ast.ImportFrom)
                  for a in n.names}
        assert "prefill" not in names, f"{f.name} defines or imports a prefill"
