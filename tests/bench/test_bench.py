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
    # 6 of the 8 experts cached per layer: SpecMoE's 4 draft experts stay pinned and misses still have slots
    cfg = preset("quick", model=str(tiny_ckpt("qwen3_moe")), out=str(out), systems=("resident", "ondemand", "specmoe"),
                 tiers=("disk",), batch_sizes=(1, 2), max_tokens=4, prompt_tokens=8, sweep_batch=2, gammas=(2,),
                 cache_fraction=0.75,
                 draft_experts=(), policies=False, substitutions=False, peers=(), cache_dir=str(tmp_path / "c"),
                 time_budget_s=None, progress=False)
    res = run_bench(cfg)
    data = json.loads((out / "results.json").read_text())
    assert data["machine"]["torch"] and data["machine"]["logical_cores"]
    assert list(out.glob("*.png")), "at least one plot"
    failed = [(r["system"], r.get("tier"), r.get("batch"), r.get("sweep"), r["status"], r.get("reason"))
              for r in data["runs"] if r["status"] != "ok"]
    assert not failed, f"every requested run must succeed: {failed}"
    ok = [r for r in data["runs"] if "sweep" not in r]
    want = {(s, b) for s in cfg.systems for b in cfg.batch_sizes}
    assert {(r["system"], r["batch"]) for r in ok} == want, "one row per requested system and batch size"
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
    assert res["runs"] == data["runs"]


def test_a_system_that_fails_is_an_error_row_with_its_reason(tiny_ckpt, tmp_path, monkeypatch):
    """A system whose LLM cannot be built is recorded as status "error" with the exception, no figures, and the
    other systems still run (what the end-to-end test above must never see)."""
    from specmoe.bench import runner

    def broken(self, path, opts, max_batch):
        if opts.get("decoding") == "specmoe":
            raise RuntimeError("planted failure")
        return make(self, path, opts, max_batch)
    make = runner.Bench.make_llm
    monkeypatch.setattr(runner.Bench, "make_llm", broken)
    cfg = preset("quick", model=str(tiny_ckpt("qwen3_moe")), out=str(tmp_path / "res"),
                 systems=("resident", "specmoe"), tiers=("host",), batch_sizes=(1,), max_tokens=2, prompt_tokens=8,
                 sweep_batch=1, gammas=(), draft_experts=(), policies=False, substitutions=False, peers=(),
                 cache_dir=str(tmp_path / "c"), time_budget_s=None, progress=False, plots=False)
    runs = {r["system"]: r for r in run_bench(cfg)["runs"] if "sweep" not in r}
    assert runs["resident"]["status"] == "ok"
    bad = runs["specmoe"]
    assert bad["status"] == "error" and "planted failure" in bad["reason"] and bad.get("tokens_per_s") is None
