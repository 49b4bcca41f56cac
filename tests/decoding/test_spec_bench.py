"""Smoke test of benchmarks/spec_bench.py on a tiny checkpoint (the script is not a test; this keeps it running)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_spec_bench_runs_and_writes_json(tiny_ckpt, tmp_path):
    out = tmp_path / "r.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "spec_bench.py"), "--model", str(tiny_ckpt("qwen3_moe")),
           "--sections", "tau,policy,throughput", "--prompts", "3", "--max-tokens", "6", "--gammas", "2",
           "--ns", "2", "--batches", "2", "--tp-max-tokens", "4", "--offload", "host", "--cache-experts", "4",
           "--out", str(out)]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    res = json.loads(out.read_text())
    assert {r["draft_policy"] for r in res["policy"]} == {"random", "hot-global", "hot-temporal"}
    assert all(r["draft_phase_bytes"] == 0 for r in res["throughput"] if r["decoding"] != "ar")
    assert "throughput" in p.stdout
