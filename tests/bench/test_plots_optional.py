"""matplotlib is the [bench] extra: without it a benchmark still writes its results JSON and skips the plot with
one printed line (benchmarks/over_ram.py's `write`, run here with the import made to fail)."""
from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from specmoe.bench import plots

REPO = Path(__file__).resolve().parents[2]


def over_ram():
    spec = importlib.util.spec_from_file_location("over_ram_script", REPO / "benchmarks" / "over_ram.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def results(tmp_path):
    """`write`'s inputs: flags, artifacts and one measured block."""
    args = SimpleNamespace(model="dry", workload="natural-forced", documents=1, temperature=0.8, systems="lru,auto",
                           fixed="eagle-g4", budgets="8GiB", limits="2x", limit_kind="cgroup", limit_floor_gib=0.0,
                           headroom_gib=1.0, max_tokens=8, window=4, prompt_tokens=32, repeats=1, threads=1,
                           io_depth=1, floor_gib=3.0, dtype="auto", dry_run=True, llama_site=None)
    art = {"path": str(tmp_path), "plan": {"model_bytes": 3 << 30}, "prompts": [[1, 2, 3]],
           "documents": [{"domain": "code", "prompt": [1, 2, 3], "forced": [4] * 8}]}
    block = {"workload": "natural-forced", "limit": "cgroup", "label": "natural-forced, cgroup limit 1.50 GiB",
             "model_over_ram": 2.0, "runs": [],
             "summary": {"lru@8GiB": {"steady_tok_s": 2.0, "steady_read_bytes_per_token": 1 << 20},
                         "auto@8GiB": {"steady_tok_s": 3.0, "steady_read_bytes_per_token": 1 << 19}}}
    return args, art, [block]


@pytest.fixture
def no_matplotlib(monkeypatch):
    """`import matplotlib` raises ImportError (None in sys.modules), as where the extra is not installed."""
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setattr(plots, "_SKIPPED", set())


def test_over_ram_writes_its_json_and_skips_the_plot_without_matplotlib(tmp_path, no_matplotlib, capsys):
    mod = over_ram()
    args, art, blocks = results(tmp_path)
    out = tmp_path / "res.json"
    for _ in range(2):  # written after every block: the skip is said once
        assert mod.write(args, art, blocks, out, [], time.perf_counter(), None) is None
    res = json.loads(out.read_text())
    assert res["blocks"][0]["summary"]["auto@8GiB"]["steady_tok_s"] == 3.0 and res["flags"]["budgets"] == "8GiB"
    assert not out.with_suffix(".png").exists()
    lines = [x for x in capsys.readouterr().out.splitlines() if x]
    assert len(lines) == 1 and "res.png skipped: matplotlib is not importable" in lines[0], lines


def test_over_ram_draws_the_plot_with_matplotlib(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    mod = over_ram()
    args, art, blocks = results(tmp_path)
    out = tmp_path / "res.json"
    assert mod.write(args, art, blocks, out, [], time.perf_counter(), None) == out.with_suffix(".png")
    assert out.with_suffix(".png").stat().st_size > 0 and "skipped" not in capsys.readouterr().out


def test_plot_or_skip_returns_what_was_drawn(tmp_path, no_matplotlib, capsys):
    calls = []
    assert plots.plot_or_skip(lambda r, p: calls.append(p) or "x.png", {}, tmp_path / "x.png") is False
    assert calls == [] and "skipped" in capsys.readouterr().out
