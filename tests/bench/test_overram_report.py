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


def test_targets_over_2x_ram_by_hand():
    sm = summary()
    block = {"summary": sm, "ratios": ratios(sm, BUDGETS, SYSTEMS, "eagle-g4"), "model_over_ram": 2.1}
    got = by_target(targets(block, BUDGETS))
    want = {
        "lru@8GiB: private memory (peak RssAnon) <= budget + 1.5 GiB (GiB over budget)": (1.0, True),
        "lru@8GiB: ~0 bytes of the repack in the page cache after the run (MiB)": (32.0, True),
        "auto@8GiB: private memory (peak RssAnon) <= budget + 1.5 GiB (GiB over budget)": (2.0, False),
        "auto@8GiB: ~0 bytes of the repack in the page cache after the run (MiB)": (100.0, False),
        "LRU at 8GiB >= 1.5x llama.cpp tok/s": (0.4, False),
        "auto at 8GiB >= 2x llama.cpp tok/s": (0.6, False),
        "LRU at llama >= 1.5x llama.cpp tok/s": (1.2, False),
        "auto at llama >= 2x llama.cpp tok/s": (0.9, False),
        "auto at 8GiB >= 1.2x LRU tok/s": (1.5, True),
        "auto at 8GiB: fewer storage bytes per token than LRU (ratio)": (0.25, True),  # a quarter of LRU's bytes
        "auto at llama >= 1.2x LRU tok/s": (0.75, False),
        "auto at llama: fewer storage bytes per token than LRU (ratio)": (1.5, False),  # half as many again
    }
    assert got == want


def test_targets_under_1_6x_ram_and_unmeasured_values():
    sm = summary()
    rt = ratios(sm, BUDGETS, SYSTEMS, "eagle-g4")
    del rt["auto@llama read bytes/token ÷ lru@llama"]
    got = by_target(targets({"summary": sm, "ratios": rt, "model_over_ram": 1.15}, BUDGETS))
    assert got["LRU at llama.cpp's footprint >= 1.0x llama.cpp tok/s"] == (1.2, True)
    assert got["LRU at 8GiB >= 0.7x llama.cpp tok/s"] == (0.4, False)
    assert "LRU at 8GiB >= 1.5x llama.cpp tok/s" not in got and "auto at llama >= 2x llama.cpp tok/s" not in got
    assert got["auto at llama: fewer storage bytes per token than LRU (ratio)"] == (None, None)  # not measured
    rt["auto@8GiB read bytes/token ÷ lru@8GiB"] = 1.0  # as many bytes as LRU: not fewer
    got = by_target(targets({"summary": sm, "ratios": rt, "model_over_ram": 1.15}, BUDGETS))
    assert got["auto at 8GiB: fewer storage bytes per token than LRU (ratio)"] == (1.0, False)


def test_committed_results_ratios_and_targets_follow_their_medians():
    res = json.loads((REPO / "benchmarks" / "results" / "over_ram.json").read_text())
    f = res["flags"]
    names = f["budgets"].split(",")
    spec = [s for s in f["systems"].split(",") if s != "llama.cpp"]
    for block in res["blocks"]:
        if "summary" not in block:
            continue
        assert block["ratios"] == pytest.approx(ratios(block["summary"], names, spec, f["fixed"]))
        assert targets(block, names) == block["targets"]


def test_the_readme_intro_says_what_the_json_records():
    """The over-RAM prose (model size, RAM, llama-cpp-python's version) comes from the results, not from a hand."""
    from specmoe.bench.overram_report import intro
    res = {"artifacts": {"plan": {"model_bytes": 27 * 2**30}}, "machine": {"ram_gib": 23.5},
           "llama_cpp": {"version": "0.3.36"}, "blocks": [{"label": "full RAM (no balloon)"}]}
    assert intro(res) == ("A model larger than RAM: a 27 GiB bf16 widened copy of the demo model on a 23.5 GiB "
                          "machine, streamed from the SSD at batch 1 against llama.cpp (llama-cpp-python 0.3.36, "
                          "bf16 GGUF, default mmap), by [`benchmarks/over_ram.py`](benchmarks/over_ram.py).")
    res["llama_cpp"] = {"version": None}
    res["blocks"].append({"label": "emulated smaller RAM (balloon 9.99 GiB)"})
    text = intro(res)
    assert "its version not recorded by this run" in text and "balloon process holding RAM" in text
