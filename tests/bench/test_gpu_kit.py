"""The GPU run kit's CPU dry run: the same entry point as on a lent GPU, at tiny sizes, so it cannot rot; run both
in the project's environment (every extra installed) and in a bare one holding only what a device machine has
(benchmarks/gpu/bare_venv.py: no httpx, fastapi, ray, openai ...), where the whole suite must still collect."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SYSTEMS = ("resident", "ondemand", "lru", "overlap", "specmoe", "auto")
STEPS = ("machine", "tests", "exactness", "bench")


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"gpu_kit_{name}", REPO / "benchmarks" / "gpu" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory):
    """A venv holding only the device machine's packages (symlinked from this interpreter's), no network."""
    return _load("bare_venv").make(tmp_path_factory.mktemp("bare") / "venv")


def in_bare(python: Path, *args, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    return subprocess.run([str(python), *args], cwd=REPO, env={**env, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=timeout)


def test_bare_venv_lacks_the_extras_and_the_whole_suite_collects(bare_python):
    """What the kit's test step relies on, and more: in the bare venv every test module imports (a module that
    needs an extra skips), so `pytest -m cuda` works there."""
    bare = _load("bare_venv")
    probe = ("import importlib.util as u, json\n"
             f"print(json.dumps(sorted(m for m in {bare.ALLOWED + bare.ABSENT!r} if u.find_spec(m) is not None)))")
    r = in_bare(bare_python, "-c", probe)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == sorted(bare.ALLOWED), "the bare venv has exactly the allowed packages of these"
    for mod in ("httpx", "fastapi", "ray"):
        r = in_bare(bare_python, "-c", f"import {mod}")
        assert r.returncode == 1 and "ModuleNotFoundError" in r.stderr, mod
    r = in_bare(bare_python, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests")
    assert r.returncode == 0 and "error" not in r.stdout.splitlines()[-1], r.stdout[-3000:] + r.stderr[-2000:]


@pytest.mark.parametrize("env", ["project", "bare"])
def test_gpu_kit_cpu_dry_run(tmp_path, env, request):
    """Every step passes: in the project's environment and in the bare one."""
    out = tmp_path / "out"
    python = sys.executable if env == "project" else str(request.getfixturevalue("bare_python"))
    base = os.environ if env == "project" else {k: v for k, v in os.environ.items()
                                                 if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    r = subprocess.run(["bash", str(REPO / "benchmarks/gpu/run.sh"), str(out), "--device", "cpu", "--tiny",
                        "--cache-dir", str(tmp_path / "cache")], cwd=tmp_path, env={**base, "PYTHON": python},
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    for f in ("machine.json", "tests.json", "exactness.json", "results.json", "README.md", "summary.md", "steps.json"):
        assert (out / f).is_file(), f
    steps = json.loads((out / "steps.json").read_text())
    assert {k: s["status"] for k, s in steps.items()} == {k: "ok" for k in STEPS}, steps
    exact = json.loads((out / "exactness.json").read_text())
    assert exact["ok"] and exact["specmoe_fp32"]["identical_sequences"] == exact["specmoe_fp32"]["sequences"] > 0
    tests = json.loads((out / "tests.json").read_text())
    # the test step collects the modules holding CUDA-marked tests and no other; on a CPU they skip
    assert tests["ok"] and "tests/experts/test_equivalence.py" in tests["files"], tests
    assert "skipped" in tests["summary"] and "error" not in tests["summary"], tests
    res = json.loads((out / "results.json").read_text())
    assert res["config"]["device"] == "cpu" and res["link_emulated"] is False
    ok = {(r["system"], r["batch"]) for r in res["runs"] if r.get("status") == "ok"}
    assert ok == {(s, b) for s in SYSTEMS for b in (1, 2)}, res["runs"]
    assert all(r["matches_reference"] == 1.0 for r in res["runs"] if r["system"] != "resident"), "lossless (fp32)"
    assert res["sweeps"]["gamma"]["rows"] and res["sweeps"]["gamma"]["batch"] in (1, 2)
    text = (out / "summary.md").read_text()
    assert "all steps passed" in text and "| specmoe |" in text
    assert all(f"| {k} | ok |" in text for k in STEPS), text


def test_a_failed_step_hides_no_other(tmp_path, monkeypatch, capsys):
    """A step that fails and two that raise: every step still runs, summary.md gives each one's status and
    names the failed ones, and the exit status is 1."""
    import specmoe.bench.widen
    kit = _load("kit")
    monkeypatch.setattr(kit, "cuda_tests", lambda out: {"files": ["tests/x.py"], "returncode": 1, "seconds": 0.0,
                                                        "summary": "1 failed, 3 passed", "ok": False})

    def boom(*a, **k):
        raise RuntimeError("simulated failure")
    monkeypatch.setattr(kit, "exactness", boom)
    monkeypatch.setattr(specmoe.bench.widen, "widened_copy", boom)
    rc = kit.main([str(tmp_path / "out"), "--device", "cpu", "--tiny", "--cache-dir", str(tmp_path / "c")])
    assert rc == 1
    assert "kit step(s) failed: tests, exactness, bench" in capsys.readouterr().err
    steps = json.loads((tmp_path / "out" / "steps.json").read_text())
    assert {k: s["status"] for k, s in steps.items()} == {"machine": "ok", "tests": "failed", "exactness": "error",
                                                          "bench": "error"}
    text = (tmp_path / "out" / "summary.md").read_text()
    assert "FAILED: tests, exactness, bench" in text and "| machine | ok |" in text
    assert "| tests | **FAILED** | 1 failed, 3 passed" in text
    assert "| exactness | **ERROR** | RuntimeError: simulated failure |" in text
    assert "host memcpy" in text, "the machine step's findings are still reported"


def test_gpu_kit_refuses_cuda_without_a_gpu(tmp_path):
    import torch
    if torch.cuda.is_available():
        return
    r = subprocess.run(["bash", str(REPO / "benchmarks/gpu/run.sh"), str(tmp_path / "o")],
                       env={**os.environ, "PYTHON": sys.executable}, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "CUDA is not available" in r.stderr and "Traceback" not in r.stderr
