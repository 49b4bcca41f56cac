"""/metrics shows what decoding="auto" chose, its exploration share and the rate it measured per configuration,
read from `llm.stats` (the collector, without a server)."""
from __future__ import annotations

import pytest

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from specmoe import LLM, SamplingParams  # noqa: E402
from specmoe.serve.metrics import ServerMetrics  # noqa: E402


def test_metrics_show_autos_choice_and_measured_rates():
    llm = LLM(decoding="auto", dtype="float32", threads=1)
    llm.generate(["def fibonacci(n):", "And God said,"], SamplingParams(max_tokens=48, ignore_eos=True))
    st = llm.stats
    fams = {f.name: f for f in text_string_to_metric_families(ServerMetrics(llm).render().decode())}
    share = fams["specmoe_auto_exploration_share"].samples[0].value
    assert share == pytest.approx(st["auto_exploration_share"])
    chosen = {s.labels["arm"]: s.value for s in fams["specmoe_auto_chosen_steps"].samples
              if s.name.endswith("_total")}
    assert chosen == {k: float(v) for k, v in st["auto_chosen_steps"].items()} and sum(chosen.values()) > 0
    rates = {(s.labels["arm"], s.labels["bucket"]): s.value
             for s in fams["specmoe_auto_measured_tokens_per_second"].samples}
    assert rates and rates == {tuple(k.rsplit("@", 1)): pytest.approx(v) for k, v in st["auto_measured_rates"].items()}
    assert all(v > 0 for v in rates.values())
    second = fams["specmoe_auto_second_trials"].samples[0].value
    assert second == st["auto_second_trials"]


def test_metrics_show_what_a_batchs_ragged_tail_leaves_each_configuration():
    from specmoe.engine.auto import controller_of
    llm = LLM(decoding="auto", dtype="float32", threads=1)
    laps = controller_of(llm).measured.laps
    for _ in range(2):  # two closed batches of 4 rows (the next batch that grows closes each)
        for B, tok in ((4, 10.0), (4, 10.0), (1, 2.0)):
            laps.step("eagle-g2", B, tok, 0.02)
    llm.generate(["def fibonacci(n):", "And God said,"], SamplingParams(max_tokens=8, ignore_eos=True))
    st = llm.stats
    assert st["auto_lap_factors"] == {"eagle-g2@4": pytest.approx(22.0 / 0.06 / 500.0, abs=1e-4)}
    fams = {f.name: f for f in text_string_to_metric_families(ServerMetrics(llm).render().decode())}
    got = {(s.labels["arm"], s.labels["bucket"]): s.value for s in fams["specmoe_auto_lap_factor"].samples}
    assert got == {("eagle-g2", "4"): pytest.approx(st["auto_lap_factors"]["eagle-g2@4"])}


def test_metrics_show_the_spread_between_moments_that_floors_a_rates_standard_error():
    from specmoe.engine.auto import controller_of
    llm = LLM(decoding="auto", dtype="float32", threads=1)
    m = controller_of(llm).measured
    m.current[8] = "eagle-g2"  # (a bucket the generation below, one row, leaves alone)
    for k in range(1 + 3 * m.need(8)):  # blocks of 4 steps at 200 and 300 tok/s (the first step: a switch's)
        m.record("eagle-g2", 8, 2.0 if (k - 1) // m.need(8) % 2 else 3.0, 0.01, k)
    llm.generate(["def fibonacci(n):"], SamplingParams(max_tokens=8, ignore_eos=True))
    st = llm.stats
    assert st["auto_moment_cv"]["8"] == pytest.approx(m.moment_cv(8), abs=1e-4) and m.moment_cv(8) > 0.15
    fams = {f.name: f for f in text_string_to_metric_families(ServerMetrics(llm).render().decode())}
    got = {s.labels["bucket"]: s.value for s in fams["specmoe_auto_moment_cv"].samples}
    assert got["8"] == pytest.approx(st["auto_moment_cv"]["8"])
