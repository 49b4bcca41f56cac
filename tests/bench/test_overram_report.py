"""specmoe.bench.overram_report's arithmetic on results set by hand (every right answer worked out in the test),
and the committed over_ram.json's ratios and targets recomputed from its own medians."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from specmoe.bench.overram_report import GiB, ratios, targets

REPO = Path(__file__).resolve().parents[2]
BUDGETS = ["8GiB", "llama"]
SYSTEMS = ["lru", "auto", "eagle-g4"]


def summary() -> dict:
    """llama.cpp 10 tok/s; at 8GiB LRU 4, auto 6 (a quarter of LRU's bytes), eagle-g4 5; at llama.cpp's footprint
    LRU 12, auto 9 (1.5x LRU's bytes), eagle-g4 not run. Memory: LRU 1 GiB over its budget with 32 MiB of the
    repack cached, auto 2 GiB over with 100 MiB."""
    return {"llama.cpp": {"steady_tok_s": 10.0},
            "lru@8GiB": {"steady_tok_s": 4.0, "steady_read_bytes_per_token": 200.0,
                         "private_over_budget_bytes": 1 * GiB, "residency_after_max": {"repack": 32 << 20}},
            "auto@8GiB": {"steady_tok_s": 6.0, "steady_read_bytes_per_token": 50.0,
                          "private_over_budget_bytes": 2 * GiB, "residency_after_max": {"repack": 100 << 20}},
            "eagle-g4@8GiB": {"steady_tok_s": 5.0, "steady_read_bytes_per_token": 80.0},
            "lru@llama": {"steady_tok_s": 12.0, "steady_read_bytes_per_token": 100.0},
            "auto@llama": {"steady_tok_s": 9.0, "steady_read_bytes_per_token": 150.0},
            "eagle-g4@llama": {"status": "none ok", "reasons": ["x"]}}


def test_ratios_by_hand():
    got = ratios(summary(), BUDGETS, SYSTEMS, "eagle-g4")
    want = {"lru@8GiB / llama.cpp": 0.4, "auto@8GiB / llama.cpp": 0.6, "eagle-g4@8GiB / llama.cpp": 0.5,
            "auto@8GiB / lru@8GiB": 1.5, "auto@8GiB read bytes/token ÷ lru@8GiB": 0.25,
            "eagle-g4@8GiB / lru@8GiB": 1.25,
            "lru@llama / llama.cpp": 1.2, "auto@llama / llama.cpp": 0.9,
            "auto@llama / lru@llama": 0.75, "auto@llama read bytes/token ÷ lru@llama": 1.5}
    assert got == pytest.approx(want) and set(got) == set(want)


def test_ratios_without_llama_cpp_have_only_the_lru_ones():
    sm = summary()
    del sm["llama.cpp"]
    got = ratios(sm, BUDGETS, SYSTEMS, "eagle-g4")
    assert got == pytest.approx({"auto@8GiB / lru@8GiB": 1.5, "auto@8GiB read bytes/token ÷ lru@8GiB": 0.25,
                                 "eagle-g4@8GiB / lru@8GiB": 1.25, "auto@llama / lru@llama": 0.75,
                                 "auto@llama read bytes/token ÷ lru@llama": 1.5})


def by_target(out: list[dict]) -> dict:
    return {t["target"]: (pytest.approx(t["value"]) if t["value"] is not None else None, t["met"]) for t in out}


def block36(workload: str, factor: float, sm: dict | None = None, runs: list | None = None) -> dict:
    sm = sm or summary36()
    return {"summary": sm, "ratios": ratios(sm, ["limit"], ["lru", "s3fifo", "auto"], "eagle-g4"),
            "workload": workload, "limit": "cgroup", "limit_plan": {"factor": factor, "limit_bytes": 4 * GiB},
            "runs": runs or []}


def summary36() -> dict:
    """llama.cpp 2 tok/s reading 100 bytes a token; LRU 1.8 tok/s, s3fifo 2.2, auto 3.2 reading 40 bytes (peak
    private 3 GiB, 0 bytes of the repack cached), LRU 5 GiB private with 4 KiB of the repack cached."""
    return {"llama.cpp": {"steady_tok_s": 2.0, "read_bytes_per_token": 100.0, "repeats_ok": 3},
            "lru@limit": {"steady_tok_s": 1.8, "read_bytes_per_token": 90.0, "repeats_ok": 3,
                          "peak_rss_anon_bytes": 5 * GiB, "residency_after_max": {"repack": 4096}},
            "s3fifo@limit": {"steady_tok_s": 2.2, "read_bytes_per_token": 80.0, "repeats_ok": 3,
                             "peak_rss_anon_bytes": 3 * GiB, "residency_after_max": {"repack": 0}},
            "auto@limit": {"steady_tok_s": 3.2, "read_bytes_per_token": 40.0, "repeats_ok": 3,
                           "peak_rss_anon_bytes": 3 * GiB, "residency_after_max": {"repack": 0}}}


def test_targets_natural_forced_at_2x_by_hand():
    got = by_target(targets(block36("natural-forced", 2.0), ["limit"]))
    at = "natural-forced 2x (cgroup)"
    assert got[f"{at}: auto@limit >= 1.5x llama.cpp tok/s"] == (1.6, True)
    assert got[f"{at}: best non-speculative policy @limit >= 1.0x llama.cpp tok/s"] == (1.1, True)  # s3fifo, not LRU
    assert got[f"{at}: auto@limit bytes read per token <= 0.5x llama.cpp's"] == (0.4, True)
    assert got[f"{at}: lru@limit peak private memory (RssAnon) <= the limit (GiB)"] == (5.0, False)
    assert got[f"{at}: auto@limit peak private memory (RssAnon) <= the limit (GiB)"] == (3.0, True)
    assert got[f"{at}: lru@limit bytes of the repack in the page cache after the run"] == (4096, False)
    assert got[f"{at}: auto@limit bytes of the repack in the page cache after the run"] == (0, True)
    assert got[f"{at}: the specmoe systems' tokens equal each other's in every repeat (repeats that differ)"] == \
        (None, None)  # no runs: not measured
    assert not any("1.2x" in k for k in got)


def test_targets_per_workload_and_limit():
    sm = summary36()
    sm["auto@limit"]["steady_tok_s"] = 2.3  # 1.15x llama.cpp
    got = by_target(targets(block36("natural-forced", 1.5, sm), ["limit"]))
    assert got["natural-forced 1.5x (cgroup): auto@limit >= 1.2x llama.cpp tok/s"] == (1.15, False)
    assert not any(">= 1.5x" in k for k in got)
    got = by_target(targets(block36("sampled", 2.0, sm), ["limit"]))
    assert got["sampled 2x (cgroup): auto@limit >= 1.2x llama.cpp tok/s"] == (1.15, False)
    assert not any("best non-speculative" in k for k in got)
    assert not any("llama.cpp tok/s" in k for k in by_target(targets(block36("sampled", 3.0, sm), ["limit"])))


def test_tokens_equal_target_counts_the_repeats_that_differ():
    def run(system, repeat, toks):
        return {"system": system, "repeat": repeat, "status": "ok", "token_ids": toks}
    runs = [run("llama.cpp", 0, [[9]]), run("lru@limit", 0, [[1, 2]]), run("auto@limit", 0, [[1, 2]]),
            run("lru@limit", 1, [[1, 2]]), run("auto@limit", 1, [[1, 3]])]
    key = "natural-forced 2x (cgroup): the specmoe systems' tokens equal each other's in every repeat (repeats that differ)"
    assert by_target(targets(block36("natural-forced", 2.0, runs=runs), ["limit"]))[key] == (1, False)
    runs[-1]["token_ids"] = [[1, 2]]
    assert by_target(targets(block36("natural-forced", 2.0, runs=runs), ["limit"]))[key] == (0, True)


def test_committed_results_ratios_and_targets_follow_their_medians():
    res = json.loads((REPO / "benchmarks" / "results" / "over_ram.json").read_text())
    f = res["flags"]
    names = f["budgets"].split(",")
    spec = [s for s in f["systems"].split(",") if s != "llama.cpp"]
    for block in res["blocks"]:
        if "summary" not in block:
            continue
        assert block["ratios"] == pytest.approx(ratios(block["summary"], names, spec, f["fixed"]))
        assert {"workload", "limit", "model_over_ram", "prompts", "max_tokens", "ratios"} <= set(block)
        assert targets(block, names) == block["targets"]


def test_the_readme_intro_says_what_the_json_records():
    """The over-RAM prose (model size, RAM, llama-cpp-python's version, the kind of limit) comes from the results."""
    from specmoe.bench.overram_report import intro
    res = {"artifacts": {"plan": {"model_bytes": 9 * 2**30}}, "machine": {"ram_gib": 23.5},
           "llama_cpp": {"version": "0.3.36"}, "blocks": [{"limit": "cgroup"}]}
    text = intro(res)
    assert text.startswith("A model larger than its memory: a 9.0 GiB bf16 widened copy of the demo model (its routing) "
                           "on a 23.5 GiB machine, limited by each run in its own cgroup v1 memory cgroup")
    assert "llama-cpp-python 0.3.36, bf16 GGUF, default mmap" in text
    res["llama_cpp"] = {"version": None}
    res["blocks"].append({"limit": "balloon"})
    text = intro(res)
    assert "its version not recorded by this run" in text and "balloon process holding RAM" in text
