"""The GPU run kit's CPU dry run: the same entry point as on a lent GPU, at tiny sizes, so it cannot rot."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SYSTEMS = ("resident", "ondemand", "lru", "overlap", "specmoe", "auto")


def test_gpu_kit_cpu_dry_run(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable}
    r = subprocess.run(["bash", str(REPO / "benchmarks/gpu/run.sh"), str(out), "--device", "cpu", "--tiny",
                        "--cache-dir", str(tmp_path / "cache")], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=1500)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    for f in ("machine.json", "tests.json", "exactness.json", "results.json", "README.md", "summary.md"):
        assert (out / f).is_file(), f
    exact = json.loads((out / "exactness.json").read_text())
    assert exact["ok"] and exact["specmoe_fp32"]["identical_sequences"] == exact["specmoe_fp32"]["sequences"] > 0
    assert json.loads((out / "tests.json").read_text())["ok"]
    res = json.loads((out / "results.json").read_text())
    assert res["config"]["device"] == "cpu" and res["link_emulated"] is False
    ok = {(r["system"], r["batch"]) for r in res["runs"] if r.get("status") == "ok"}
    assert ok == {(s, b) for s in SYSTEMS for b in (1, 2)}, res["runs"]
    assert all(r["matches_reference"] == 1.0 for r in res["runs"] if r["system"] != "resident"), "lossless (fp32)"
    assert res["sweeps"]["gamma"]["rows"] and res["sweeps"]["gamma"]["batch"] in (1, 2)
    assert "| specmoe |" in (out / "summary.md").read_text()


def test_gpu_kit_refuses_cuda_without_a_gpu(tmp_path):
    import torch
    if torch.cuda.is_available():
        return
    r = subprocess.run(["bash", str(REPO / "benchmarks/gpu/run.sh"), str(tmp_path / "o")],
                       env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "CUDA is not available" in r.stderr and "Traceback" not in r.stderr
