"""`/metrics`: the server's Prometheus registry (one per app, so several apps can live in a process).

Request-level series come from the engine loop (queue gauges, finished requests by reason, TTFT,
inter-token latency, end-to-end latency, rejections); engine-level series are read from
`llm.stats` at scrape time, under the engine's step lock (tokens, steps, expert bytes moved,
expert-cache hit rate, SpecMoE tokens per step, fetch wait). Names start with `specmoe_`.

Inter-token latency is the gap between two consecutive outputs of one request, as a streaming
client sees it: a SpecMoE step that emits several tokens of a request at once is one output.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0,
                   3.0, 5.0, 10.0, 20.0, 60.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)


class ServerMetrics:
    def __init__(self, llm):
        self.llm = llm
        self.engine = None
        r = self.registry = CollectorRegistry()
        self.running = Gauge("specmoe_requests_running", "requests decoding now (holding a KV slot)", registry=r)
        self.waiting = Gauge("specmoe_requests_waiting", "requests queued for a KV slot", registry=r)
        self.slots = Gauge("specmoe_kv_slots", "KV-cache slots the engine may use (max concurrent sequences)",
                           registry=r)
        self.free_slots = Gauge("specmoe_kv_slots_free", "KV-cache slots free now (or still to grow)", registry=r)
        self.finished_total = Counter("specmoe_requests_finished", "requests ended, by reason: stop, length, "
                                      "aborted (client gone), timeout, shutdown, error", ["reason"], registry=r)
        self.rejected_total = Counter("specmoe_requests_rejected", "requests refused before queueing: 429 (queue "
                                      "full), 503 (engine down), 413 (body too large) or 408 (body too slow), "
                                      "by status", ["status"], registry=r)
        self.ttft = Histogram("specmoe_time_to_first_token_seconds", "arrival to the first generated token",
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("specmoe_inter_token_latency_seconds", "gap between consecutive outputs of a request",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("specmoe_e2e_request_latency_seconds", "arrival to the end of a request",
                             buckets=E2E_BUCKETS, registry=r)
        r.register(_StatsCollector(self))

    def bind(self, engine) -> None:
        """Read the queue gauges from this engine at scrape time."""
        self.engine = engine
        self.running.set_function(lambda: engine.running)
        self.waiting.set_function(lambda: engine.waiting)
        self.slots.set_function(lambda: engine.slots)
        self.free_slots.set_function(lambda: engine.free_slots)

    # called from the engine thread
    def observe_ttft(self, s: float) -> None:
        self.ttft.observe(s)

    def observe_itl(self, s: float) -> None:
        self.itl.observe(s)

    def finished(self, reason: str, e2e_s: float | None = None) -> None:
        self.finished_total.labels(reason=reason).inc()
        if e2e_s is not None:
            self.e2e.observe(e2e_s)

    def rejected(self, status: int) -> None:
        self.rejected_total.labels(status=str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _StatsCollector:
    """Engine counters from `llm.stats`, read under the engine's step lock (never mid-step)."""

    def __init__(self, metrics: ServerMetrics):
        self.m = metrics

    def describe(self):
        return []  # collected lazily: nothing to check at registration

    def collect(self):
        eng = self.m.engine
        if eng is not None:
            with eng.step_lock:
                s = self.m.llm.stats
        else:
            s = self.m.llm.stats
        bd = s.get("step_breakdown", {})

        def counter(name, doc, v):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], float(v))
            return c

        def gauge(name, doc, v):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float(v))
            return g
        yield counter("specmoe_prompt_tokens", "prompt tokens prefilled", s["prompt_tokens"])
        yield counter("specmoe_generation_tokens", "tokens generated", s["generated_tokens"])
        yield counter("specmoe_decode_steps", "decode steps (each: one token per sequence for AR, drafts + "
                      "verification for SpecMoE)", s["decode_steps"])
        yield counter("specmoe_expert_bytes_moved", "bytes of experts copied from the backing tier to the compute "
                      "device", s.get("bytes_moved", 0))
        yield counter("specmoe_expert_fetch_wait_seconds", "decode time spent waiting for expert loads",
                      bd.get("fetch_wait_s", 0.0))
        yield counter("specmoe_decode_seconds", "time in decode steps", s["decode_time_s"])
        yield counter("specmoe_prefill_seconds", "time in prefill", s["prefill_time_s"])
        yield gauge("specmoe_expert_cache_hit_rate", "expert-cache hits / requests (1 when every expert is "
                    "resident)", s.get("hit_rate", 1.0))
        if "io_reads" in s:  # disk tier: direct reads, their time, and the rows they land in
            yield counter("specmoe_disk_reads", "experts read from the disk tier", s["io_reads"])
            yield counter("specmoe_disk_read_seconds", "seconds in disk-tier reads (summed over reads)",
                          s["io_read_s"])
        if "host_rows_bytes" in s:
            yield gauge("specmoe_host_rows_bytes", "host rows expert reads land in (cache slots, scratch, staging)",
                        s["host_rows_bytes"])
            yield gauge("specmoe_host_rows_huge_page_bytes", "of those, bytes backed by transparent huge pages",
                        s["host_rows_huge_bytes"])
        tps = s.get("tokens_per_step", 1.0 if s["decode_steps"] else 0.0)
        yield gauge("specmoe_tokens_per_step", "tokens emitted per sequence per decode step (SpecMoE: accepted "
                    "drafts + 1; AR: 1)", tps)
        path = GaugeMetricFamily("specmoe_kernel_path", "the matmul path that computes (1 on the one in use)",
                                 labels=["path"])
        path.add_metric([s.get("kernels", "torch")], 1.0)
        yield path
        if "plain_step_share" in s:
            yield gauge("specmoe_plain_step_share", "share of decode steps in which no sequence drafted (auto's plain "
                        "steps)", s["plain_step_share"])
        if "auto_exploration_share" in s:  # decoding="auto": what it chose and what it measured
            yield gauge("specmoe_auto_exploration_share", "share of auto's decode steps after its first 64 spent "
                        "trying configurations other than the best measured one", s["auto_exploration_share"])
            chosen = CounterMetricFamily("specmoe_auto_chosen_steps", "decode steps auto ran each configuration "
                                         "(plain, a drafter or mix, -g2: short drafts)", labels=["arm"])
            for arm, n in s["auto_chosen_steps"].items():
                chosen.add_metric([arm], float(n))
            yield chosen
            yield CounterMetricFamily("specmoe_auto_second_trials", "configurations auto tried a second time after "
                                      "one trial put them behind the best (the better trial stands)",
                                      value=float(s["auto_second_trials"]))
            rates = GaugeMetricFamily("specmoe_auto_measured_tokens_per_second", "tokens/s auto measured for a "
                                      "configuration at a batch bucket in this process", labels=["arm", "bucket"])
            for key, v in s["auto_measured_rates"].items():
                arm, bucket = key.rsplit("@", 1)
                rates.add_metric([arm, bucket], float(v))
            yield rates
            laps = GaugeMetricFamily("specmoe_auto_lap_factor", "whole batches' tokens/s over their full steps' for "
                                     "a configuration at a batch bucket (what the ragged tail leaves)",
                                     labels=["arm", "bucket"])
            for key, v in s.get("auto_lap_factors", {}).items():
                arm, bucket = key.rsplit("@", 1)
                laps.add_metric([arm, bucket], float(v))
            yield laps
            cv = GaugeMetricFamily("specmoe_auto_moment_cv", "spread between moments at a batch bucket (relative "
                                   "standard deviation of the exploited configuration's 4-step blocks): the floor "
                                   "on a measured rate's standard error", labels=["bucket"])
            for bucket, v in s.get("auto_moment_cv", {}).items():
                cv.add_metric([bucket], float(v))
            yield cv
        drafters = s.get("drafters") or {}
        if drafters:
            rows = CounterMetricFamily("specmoe_drafter_rows", "sequence-steps drafted, by drafter", labels=["drafter"])
            tau = GaugeMetricFamily("specmoe_drafter_tokens_per_step", "tokens emitted per drafted sequence-step "
                                    "(accepted drafts + 1), by drafter", labels=["drafter"])
            for name, d in drafters.items():
                rows.add_metric([name], float(d["rows"]))
                tau.add_metric([name], float(d["tokens_per_step"]))
            yield rows
            yield tau
