"""The control bench's arithmetic and report (the runs themselves are `specmoe bench --control`)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from specmoe.bench import auto_control as C


def test_crossing_interpolates_in_log_phi():
    t = [{"phi": 0.5, "s": 0.6}, {"phi": 2.0, "s": 1.4}, {"phi": 8.0, "s": 2.0}]
    x = C.crossing(t, "s")
    assert 0.5 < x < 2.0 and x == pytest.approx(1.0, rel=1e-6)
    assert C.crossing([{"phi": 1.0, "s": 0.5}, {"phi": 4.0, "s": 0.9}], "s") is None
    assert C.crossing([{"phi": 0.3, "s": 1.2}], "s") == 0.3


def test_prediction_summary_and_best_baseline():
    preds = [["plain", 4, 1.1, 1.5, 1.0, 4.0, 3.0], ["plain", 4, 0.8, 1.0, 1.0, 4.0, 3.0],
             ["spec", 4, 2.0, 2.0, 2.5, 4.0, 5.0]]
    s = C.prediction_summary(preds)
    assert s["plain"]["steps"] == 2 and s["plain"]["median_abs_err"] == pytest.approx(0.15)
    assert s["spec"]["median_abs_err"] == pytest.approx(0.2) and s["predicted_spec_tok_s"] == pytest.approx(11 / 3)
    rows = [{"status": "ok", "model": "main", "tier": "disk", "batch": 4, "system": n, "tokens_per_s": v}
            for n, v in (("lru", 10.0), ("ondemand", 12.0), ("auto", 30.0), ("static", 5.0))]
    assert C.best_baseline(rows, "main", "disk", 4)["system"] == "ondemand", "auto is not a baseline"
    assert C._phi({"breakdown": {"fetch_wait_s": 1.0, "decode_time_s": 3.0}}) == pytest.approx(0.5)


def test_report_reads_every_figure_from_the_results():
    res = {"command": "specmoe bench --control", "machine": {"cpu_model": "cpu", "loadavg_at_start": [1]},
           "elapsed_s": 10, "loadavg_at_end": [1],
           "systems": {"median_abs_err_all": 0.123, "auto_min_vs_best": 0.97, "table": [
               {"model": "main", "batch": 1, "best_baseline": "lru", "best_baseline_tok_s": 50.0, "phi": 0.3,
                "auto_vs_best": 0.97, "auto_steps": {"plain": 10, "spec": 1}, "auto-spec_vs_best": 0.5,
                "auto_plain_vs_lru": 0.99, "plain_step_median_abs_err": 0.1, "plain_step_median_abs_err_raw": 0.4}]},
           "phi_sweep": {"batch": 16, "pays_from_phi_measured": 1.7, "pays_from_phi_predicted": 2.2,
                         "table": [{"link_gbps": 0.25, "best_baseline": "lru", "phi": 4.0,
                                    "auto-spec_speedup": 1.6, "auto_speedup": 1.55, "predicted_spec_speedup": 1.4}]}}
    text = C.report(res)
    for figure in ("12%", "0.97", "10/1", "1.70", "2.20", "1.55", "0.25"):
        assert figure in text, figure


def test_committed_control_md_is_generated_from_control_json():
    """benchmarks/results/control.md is exactly what control.json generates, and the JSON's summary figures
    follow its own rows and tables (the best baseline per batch, ratios to it, the aggregates, the φ crossings)."""
    rdir = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    res = json.loads((rdir / "control.json").read_text())
    assert (rdir / "control.md").read_text() == C.report(res), \
        "control.md is stale or hand-edited: run `python -m specmoe.bench.auto_control`"
    sy = res["systems"]
    for e in sy["table"]:
        best = C.best_baseline(sy["rows"], e["model"], "disk", e["batch"])
        assert (best["system"], best["tokens_per_s"]) == (e["best_baseline"], e["best_baseline_tok_s"])
        assert e["phi"] == pytest.approx(C._phi(best))
        for name in ("auto", "auto-plain", "auto-spec", "lru"):
            if e.get(f"{name}_tok_s"):
                assert e[f"{name}_vs_best"] == pytest.approx(e[f"{name}_tok_s"] / e["best_baseline_tok_s"])
    errs = [e[k] for e in sy["table"] for k in ("plain_step_median_abs_err", "spec_step_median_abs_err")
            if e.get(k) is not None]
    assert sy["median_abs_err_all"] == pytest.approx(float(np.median(errs)))
    assert sy["auto_min_vs_best"] == min(e["auto_vs_best"] for e in sy["table"] if e.get("auto_vs_best"))
    ph = res["phi_sweep"]
    for e in ph["table"]:
        for name in ("auto", "auto-spec"):
            if e.get(f"{name}_tok_s"):
                assert e[f"{name}_speedup"] == pytest.approx(e[f"{name}_tok_s"] / e["best_baseline_tok_s"])
    assert ph["pays_from_phi_measured"] == C.crossing(ph["table"], "auto-spec_speedup")
    assert ph["pays_from_phi_predicted"] == C.crossing(ph["table"], "predicted_spec_speedup")


def test_a_hand_edited_control_md_figure_fails_the_check():
    rdir = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
    res = json.loads((rdir / "control.json").read_text())
    res["systems"]["table"][0]["auto_vs_best"] += 0.5  # a figure that no longer matches the committed page
    assert C.report(res) != (rdir / "control.md").read_text()
