"""`specmoe bench` end to end on a tiny checkpoint: results.json, PNGs, and figures that agree
with each other (ratios from the same run's rows, lossless output against the reference)."""
from __future__ import annotations

import json

import pytest

from specmoe.bench import preset, run_bench
from specmoe.bench import systems as S


def test_unavailable_options_are_reported_not_faked():
    why = S.unavailable_reason({"offload": "disk", "no_such_option": 1})
    assert why and "not available in this build" in why
    why = S.unavailable_reason({"offload": "tape"})
    assert why and "tape" in why


def test_bench_end_to_end(tiny_ckpt, tmp_path):
    out = tmp_path / "res"
    cfg = preset("quick", model=str(tiny_ckpt("qwen3_moe")), out=str(out), systems=("resident", "ondemand", "specmoe"),
                 tiers=("disk",), batch_sizes=(1, 2), max_tokens=4, prompt_tokens=8, sweep_batch=2, gammas=(2,),
                 draft_experts=(), policies=False, substitutions=False, peers=(), cache_dir=str(tmp_path / "c"),
                 time_budget_s=None, progress=False)
    res = run_bench(cfg)
    data = json.loads((out / "results.json").read_text())
    assert data["machine"]["torch"] and data["machine"]["logical_cores"]
    assert list(out.glob("*.png")), "at least one plot"
    ok = [r for r in data["runs"] if r["status"] == "ok" and "sweep" not in r]
    assert {r["system"] for r in ok} >= {"resident"}
    for r in ok:
        assert r["generated_tokens"] == r["batch"] * cfg.max_tokens  # EOS ignored: same work for every system
        assert r["tokens_per_s"] == pytest.approx(r["generated_tokens"] / r["wall_s"])
        if r["system"] != "resident":
            assert r["matches_reference"] == 1.0, f"{r['system']} is not lossless"
        if r.get("bytes_moved") is not None:
            assert r["bytes_per_token"] == pytest.approx(r["bytes_moved"] / r["generated_tokens"])
            if r.get("decode_bytes") is not None:
                assert r["prefill_bytes"] + r["decode_bytes"] == r["bytes_moved"]
    for h in data["headline"]:
        mine = next(r for r in ok if r["system"] == "specmoe" and r["batch"] == h["batch"] and r["tier"] == h["tier"])
        other = next(r for r in ok if r["system"] == h["vs"] and r["batch"] == h["batch"] and r["tier"] == h["vs_tier"])
        assert h["speedup"] == pytest.approx(mine["tokens_per_s"] / other["tokens_per_s"])
    for r in data["runs"]:
        assert r["status"] in ("ok", "unavailable", "error", "skipped")
        if r["status"] != "ok":
            assert r.get("reason") and r.get("tokens_per_s") is None
    assert res["runs"] == data["runs"]
