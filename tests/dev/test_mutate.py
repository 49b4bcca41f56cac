"""The mutation check (`python -m specmoe.dev.mutate`): its list matches the tree, and the runner on a toy
repository catches a planted bug, reports a harmless change as survived, skips equivalent mutants, refuses stale
ones, and always puts the original file back, in a copy, never in the source tree."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from specmoe.dev import mutate
from specmoe.dev.mutants import MUTANTS, Mutant

ISSUE_38 = {"controller_first_drafter_only", "weight_major_threshold_ignored", "probe_first_winning_size",
            "api_key_any_bearer", "overram_ratio_inverted", "overram_fewer_bytes_target_inverted",
            "kv_heads_default_one"}
BEING_REWRITTEN = ("specmoe/experts/", "specmoe/kernels/", "specmoe/models/moe.py", "specmoe/models/layers.py",
                   "specmoe/weights/autodtype.py")


def test_the_list_matches_the_tree():
    assert mutate.check(MUTANTS) == []
    assert len(MUTANTS) >= 30 and ISSUE_38 <= {m.name for m in MUTANTS}
    assert {m.area for m in MUTANTS} == {"decoding", "experts", "models", "families", "serve", "bench"}
    assert not [m.name for m in MUTANTS if m.file.startswith(BEING_REWRITTEN)]
    assert all(m.why and (m.tests or m.equivalent) for m in MUTANTS)


def toy(tmp_path: Path) -> Path:
    """A repository with a package `specmoe` of one function and its test (the real specmoe stays installed: the
    copy must be the one imported)."""
    src = tmp_path / "src"
    (src / "specmoe").mkdir(parents=True)
    (src / "specmoe" / "__init__.py").write_text("")
    (src / "specmoe" / "toy.py").write_text("def add(a, b):\n    return a + b\n")
    (src / "tests").mkdir()
    (src / "tests" / "test_toy.py").write_text("from specmoe.toy import add\n\n\ndef test_add():\n"
                                               "    assert add(2, 3) == 5\n")
    (src / "pyproject.toml").write_text("[tool.pytest.ini_options]\ntestpaths = [\"tests\"]\n")
    return src


def m(name, original, replacement, equivalent=None):
    return Mutant(name, "bench", "specmoe/toy.py", original, replacement, ("tests/test_toy.py",), name, equivalent)


def test_runner_on_a_toy_repository(tmp_path):
    src = toy(tmp_path)
    before = (src / "specmoe" / "toy.py").read_bytes()
    mutants = [m("minus", "a + b", "a - b"), m("swapped", "return a + b", "return b + a"),
               m("commuted", "a + b", "b + a", equivalent="addition commutes"), m("gone", "a * b", "a / b")]
    lines = []
    res = mutate.run(mutants, timeout=120, baseline=True, native=False, src=src, out=lines.append)
    assert res == {"caught": ["minus"], "survived": ["swapped"], "equivalent": ["commuted"], "stale": ["gone"],
                   "errors": []}, lines
    assert lines[0].startswith("baseline: 1 test selections on the unmutated copy: passed")
    assert any("minus: caught" in x and "assert" in x for x in lines), lines
    assert (src / "specmoe" / "toy.py").read_bytes() == before  # the source tree is never written
    s = mutate.summary(res)
    assert s.startswith("mutants: 4, caught 1, survived 1, equivalent (excluded) 1, stale 1, errors 0; caught 1/2 = 50%")
    assert "survived: swapped" in s


def test_a_failing_baseline_stops_the_run(tmp_path):
    src = toy(tmp_path)
    (src / "specmoe" / "toy.py").write_text("def add(a, b):\n    return a * b\n")
    lines = []
    res = mutate.run([m("x", "a * b", "a - b")], timeout=120, baseline=True, native=False, src=src, out=lines.append)
    assert res["errors"] == ["baseline"] and res["caught"] == [] and "fix them first" in lines[-1]


def test_planted_file_is_restored_on_interrupt_and_stale_snippets_touch_nothing(tmp_path):
    src = toy(tmp_path)
    f = src / "specmoe" / "toy.py"
    before = f.read_bytes()
    with pytest.raises(KeyboardInterrupt):
        with mutate.Planted(src, m("minus", "a + b", "a - b")):
            assert "a - b" in f.read_text()
            raise KeyboardInterrupt
    assert f.read_bytes() == before
    with pytest.raises(mutate.StaleMutant, match="0 times"):
        with mutate.Planted(src, m("gone", "a * b", "a / b")):
            pass
    assert f.read_bytes() == before


def test_child_imports_the_copy_and_turns_native_kernels_off(tmp_path, monkeypatch):
    monkeypatch.delenv("SPECMOE_NATIVE", raising=False)
    env = mutate.child_env(tmp_path, native=False)
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(tmp_path) and env["PYTHONDONTWRITEBYTECODE"] == "1"
    assert env["SPECMOE_NATIVE"] == "0" and "SPECMOE_NATIVE" not in mutate.child_env(tmp_path, native=True)


def test_cli_list_and_only(capsys):
    assert mutate.main(["--list", "--only", "api_key_any_bearer", "kv_heads_default_one"]) == 0
    out = capsys.readouterr().out
    assert "api_key_any_bearer" in out and "specmoe/serve/app.py" in out and out.rstrip().endswith("2 mutants")
    assert "test_a_wrong_key_is_refused_over_the_socket" in out
    with pytest.raises(SystemExit, match="unknown mutant"):
        mutate.main(["--only", "no_such_mutant"])
