"""/metrics shows the disk tier's reads (count, seconds) and the host rows they land in, with the bytes of them on
transparent huge pages, read from `llm.stats` (the collector, without a server)."""
from __future__ import annotations

import pytest

pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from specmoe import LLM, SamplingParams  # noqa: E402
from specmoe.serve.metrics import ServerMetrics  # noqa: E402


def test_metrics_show_disk_reads_and_huge_page_rows():
    llm = LLM(threads=1, offload="disk", cache_experts=4, cache_policy="lru")
    llm.generate(["def fibonacci(n):"], SamplingParams(max_tokens=8, ignore_eos=True))
    st = llm.stats
    assert st["io_reads"] > 0 and st["io_read_s"] > 0
    fams = {f.name: f for f in text_string_to_metric_families(ServerMetrics(llm).render().decode())}

    def value(name):
        return next(s.value for s in fams[name].samples if not s.name.endswith("_created"))
    assert value("specmoe_disk_reads") == st["io_reads"]
    assert value("specmoe_disk_read_seconds") == pytest.approx(st["io_read_s"])
    assert value("specmoe_host_rows_bytes") == st["host_rows_bytes"] > 0
    assert value("specmoe_host_rows_huge_page_bytes") == st["host_rows_huge_bytes"]


def test_a_resident_model_shows_no_disk_reads():
    fams = {f.name for f in text_string_to_metric_families(ServerMetrics(LLM(threads=1)).render().decode())}
    assert "specmoe_disk_reads" not in fams and "specmoe_host_rows_bytes" not in fams
