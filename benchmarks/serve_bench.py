"""Load test for `specmoe serve`: Poisson arrivals at given rates (or a fixed number of concurrent
clients) against a running server, streaming completions, reporting throughput and TTFT / ITL /
TPOT percentiles. Not a test: it prints a table and writes JSON into benchmarks/results/.

    # against a server you started:
    .venv/bin/python benchmarks/serve_bench.py --url http://127.0.0.1:8000 --rates 1,2,4 --duration 30
    # plain vs SpecMoE: the tool starts `specmoe serve` once per decoding mode (extra flags via --server-args)
    .venv/bin/python benchmarks/serve_bench.py --launch ar,specmoe --rates 1,2,4 --duration 30 \
        --server-args "--offload host --cache-experts 8 --threads 1"
    # soak: 64 clients, each sending its next request when the last one ends, for 60 s
    .venv/bin/python benchmarks/serve_bench.py --launch ar --concurrency 64 --duration 60

Definitions (as vLLM's benchmark_serving): TTFT = request sent → first streamed text; ITL = the
gaps between consecutive streamed text chunks of a request (a SpecMoE step that emits several tokens
of a request at once sends them as one chunk); TPOT = (end − TTFT) / (completion tokens − 1) per
request; throughput = completion tokens / wall time from the first arrival to the last completion.
Every request asks for `max_tokens` with EOS ignored, so all requests have the same length. A
request either completes (its stream ends with a finish_reason, usage and [DONE]), gets a clean
error (an HTTP status with an OpenAI error body, or an error event), or is *lost* (anything else:
a broken connection, a stream without [DONE], a malformed chunk); the JSON counts all three.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def load_prompts(n: int, max_chars: int) -> list[str]:
    """n prompts from benchmarks/prompts/*.jsonl, domains round-robin, each cut to max_chars."""
    per = [[json.loads(x)["prompt"][:max_chars] for x in f.read_text().splitlines() if x.strip()]
           for f in sorted((REPO / "benchmarks" / "prompts").glob("*.jsonl"))]
    out, i = [], 0
    while len(out) < n:
        out.append(per[i % len(per)][(i // len(per)) % len(per[i % len(per)])])
        i += 1
    return out


async def one_request(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    """Send one streaming completion; return its timings and how it ended (completed / error / lost)."""
    rec = {"sent": time.perf_counter(), "chunks": [], "tokens": 0, "status": None, "outcome": "lost", "error": None}
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            rec["status"] = r.status_code
            if r.status_code != 200:
                err = json.loads(await r.aread()).get("error", {})
                rec["outcome"], rec["error"] = ("error", err.get("message")) if err.get("message") else ("lost", None)
                return rec
            finished = done = False
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    rec["outcome"], rec["error"] = "error", chunk["error"].get("message")
                    continue
                for ch in chunk.get("choices", []):
                    if ch.get("text"):
                        rec["chunks"].append(time.perf_counter())
                    finished = finished or ch.get("finish_reason") is not None
                if chunk.get("usage"):
                    rec["tokens"] = chunk["usage"]["completion_tokens"]
            rec["end"] = time.perf_counter()
            if rec["outcome"] != "error":
                rec["outcome"] = "completed" if (done and finished and rec["tokens"]) else "lost"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        rec["outcome"], rec["error"] = "lost", f"{type(e).__name__}: {e}"
    return rec


def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(recs: list[dict], wall: float) -> dict:
    ok = [r for r in recs if r["outcome"] == "completed"]
    ttft = [r["chunks"][0] - r["sent"] for r in ok if r["chunks"]]
    itl = [b - a for r in ok for a, b in zip(r["chunks"], r["chunks"][1:])]
    tpot = [(r["end"] - r["chunks"][0]) / (r["tokens"] - 1) for r in ok if r["chunks"] and r["tokens"] > 1]
    tokens = sum(r["tokens"] for r in ok)
    out = {"requests": len(recs), "completed": len(ok), "errors": sum(r["outcome"] == "error" for r in recs),
           "lost": sum(r["outcome"] == "lost" for r in recs), "completion_tokens": tokens, "wall_s": wall,
           "throughput_tok_s": tokens / wall if wall else 0.0, "request_throughput": len(ok) / wall if wall else 0.0,
           "error_samples": sorted({r["error"] for r in recs if r["error"]})[:5]}
    for name, xs in (("ttft_s", ttft), ("itl_s", itl), ("tpot_s", tpot)):
        out[name] = {"p50": pct(xs, 50), "p99": pct(xs, 99), "mean": sum(xs) / len(xs) if xs else None, "n": len(xs)}
    return out


async def run_load(url: str, *, rate: float | None, concurrency: int | None, duration: float, prompts: list[str],
                   max_tokens: int, model: str | None, seed: int, drain_s: float) -> dict:
    """Poisson arrivals at `rate` req/s for `duration` s, or `concurrency` closed-loop clients for `duration` s."""
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    recs: list[dict] = []
    counter = iter(range(10**9))

    def body():
        b = {"prompt": prompts[next(counter) % len(prompts)], "max_tokens": max_tokens, "temperature": 0,
             "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        return {**b, "model": model} if model else b

    async with httpx.AsyncClient(timeout=httpx.Timeout(duration + drain_s + 60), limits=limits) as client:
        t0 = time.perf_counter()
        tasks = []
        if rate is not None:
            t = 0.0
            while True:
                t += rng.expovariate(rate)
                if t > duration:
                    break
                await asyncio.sleep(max(0.0, t0 + t - time.perf_counter()))
                tasks.append(asyncio.create_task(one_request(client, url, body())))
        else:
            async def worker():
                while time.perf_counter() - t0 < duration:
                    recs.append(await one_request(client, url, body()))
            tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
        done, pending = await asyncio.wait(tasks, timeout=duration + drain_s) if tasks else (set(), set())
        for t in pending:
            t.cancel()
        if rate is not None:
            recs = [t.result() for t in done]
            recs += [{"outcome": "lost", "error": "not finished before the drain timeout", "chunks": [], "tokens": 0}
                     for _ in pending]
        ends = [r["end"] for r in recs if r.get("end")]
        wall = (max(ends) if ends else time.perf_counter()) - t0
    return summarize(recs, wall)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Launched:
    """`specmoe serve` in a subprocess on a free loopback port, for one decoding mode."""

    def __init__(self, decoding: str, server_args: list[str]):
        self.port = free_port()
        cmd = [sys.executable, "-m", "specmoe", "serve", "--port", str(self.port), "--log-level", "warning",
               "--decoding", decoding, *server_args]
        env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
        self.cmd = " ".join(shlex.quote(c) for c in cmd)
        self.proc = subprocess.Popen(cmd, env=env, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True)
        self.url = f"http://127.0.0.1:{self.port}"
        t0 = time.monotonic()
        while True:
            if self.proc.poll() is not None:
                raise SystemExit(f"specmoe serve exited: {self.proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() - t0 > 300:
                raise SystemExit("specmoe serve did not come up in 300 s")
            time.sleep(0.2)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGINT)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def server_info(url: str) -> dict:
    m = httpx.get(url + "/v1/models", timeout=10).json()["data"][0]
    return {"model": m["id"], "max_model_len": m.get("max_model_len")}


def scrape(url: str) -> dict:
    """The server's own counters (for tokens per step and expert traffic)."""
    from prometheus_client.parser import text_string_to_metric_families
    out = {}
    for fam in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=10).text):
        for s in fam.samples:
            if not s.labels:
                out[s.name] = s.value
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--url", help="a running server (label its results with --label)")
    g.add_argument("--launch", help="decoding modes to start `specmoe serve` with, e.g. ar,specmoe")
    ap.add_argument("--label", default="server", help="--url: the name of this server's results")
    ap.add_argument("--server-args", default="--threads 1", help="--launch: extra `specmoe serve` flags")
    ap.add_argument("--rates", default="1,2,4", help="request rates (req/s), comma-separated")
    ap.add_argument("--concurrency", type=int, default=None, help="closed loop with this many clients instead")
    ap.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals per rate")
    ap.add_argument("--drain", type=float, default=120.0, help="seconds to wait for requests after the arrivals")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-chars", type=int, default=200, help="prompts are cut to this many characters")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "serve_bench.json"))
    a = ap.parse_args(argv)
    prompts = load_prompts(256, a.prompt_chars)
    loads = [("concurrency", a.concurrency)] if a.concurrency else [("rate", float(r)) for r in a.rates.split(",")]
    targets = [(a.label, None)] if a.url else [(d, d) for d in a.launch.split(",")]
    sys.path.insert(0, str(REPO))
    from specmoe.bench.machine import provenance
    result = {"command": " ".join(shlex.quote(x) for x in sys.argv), "provenance": provenance(),
              "machine": platform.platform(),
              "cpus": os.cpu_count(), "max_tokens": a.max_tokens, "duration_s": a.duration, "runs": []}
    for label, decoding in targets:
        srv = Launched(decoding, shlex.split(a.server_args)) if decoding else None
        url = srv.url if srv else a.url.rstrip("/")
        try:
            info = server_info(url)
            for kind, value in loads:
                m0 = scrape(url)
                s = asyncio.run(run_load(url, rate=value if kind == "rate" else None,
                                         concurrency=value if kind == "concurrency" else None, duration=a.duration,
                                         prompts=prompts, max_tokens=a.max_tokens, model=info["model"],
                                         seed=a.seed, drain_s=a.drain))
                m1 = scrape(url)
                steps = m1["specmoe_decode_steps_total"] - m0["specmoe_decode_steps_total"]
                s.update(label=label, decoding=decoding, **{kind: value}, server=srv.cmd if srv else url,
                         tokens_per_step=m1.get("specmoe_tokens_per_step"), decode_steps=steps,
                         expert_bytes_moved=m1["specmoe_expert_bytes_moved_total"]
                         - m0["specmoe_expert_bytes_moved_total"])
                result["runs"].append(s)
                f = lambda x: f"{x * 1e3:8.1f}" if x is not None else "     n/a"  # noqa: E731
                print(f"{label:>10} {kind}={value:<5g} done {s['completed']:4d}/{s['requests']:<4d} err {s['errors']} "
                      f"lost {s['lost']}  {s['throughput_tok_s']:7.1f} tok/s  TTFT p50/p99 {f(s['ttft_s']['p50'])}"
                      f"{f(s['ttft_s']['p99'])} ms  ITL p50/p99 {f(s['itl_s']['p50'])}{f(s['itl_s']['p99'])} ms  "
                      f"TPOT p50 {f(s['tpot_s']['p50'])} ms", flush=True)
        finally:
            if srv:
                srv.stop()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
