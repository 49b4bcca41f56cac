"""Hostile clients against a real `specmoe serve` on a loopback port: what one client costs the others.
Not a test (tests/serve/test_hostile.py asserts the behaviour); this measures it and writes
benchmarks/results/serve_hostile.json with the commit it ran on.

    .venv/bin/python benchmarks/serve_hostile.py            # the three scenarios, ~1.5 min
    .venv/bin/python benchmarks/serve_hostile.py --rounds 3 --scenarios default

Scenarios (each a fresh `specmoe serve --threads 1 --max-model-len 1024 --max-waiting 8`, key from
SPECMOE_API_KEY, header and body timeouts 0.5 s so that a timeout answers within 1 s):
- `default`: the default body limit (4 MiB): a 10 MB request is refused (413) after its body is drained.
- `big-bodies`: --max-body-size 64MiB: a 10 MB prompt is read and parsed, then refused on its character
  count (400 context_length_exceeded) without being tokenized.
- `control`: the attackers send to a bare socket sink (reads the body, answers 413) instead, while /health
  and the small completions go to an idle `specmoe serve`: what the attack costs on this machine anyway
  (its CPUs are shared by the server, the attackers, the measuring client and the kernel's copies).
In each, `--rounds` times (one round a `--period`), three clients (separate processes) send a 10 MB
completion at once, while one client polls /health every 50 ms and another sends small completions
(8 tokens, greedy) back to back; the latencies of those in flight while a 10 MB request was are compared
with the same requests' on the idle server (targets: /health <= 0.5 s, a small completion <= 2x
its idle latency). The server's RSS is read from /proc before and 2 s after (target: <= +200 MB). Then
(in `default`) every hostile case is sent once: its status, seconds to the answer (target <= 1 s) and whether the body
is OpenAI's error shape.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
KEY = "bench-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
MODEL = "specmoe-tiny-moe"
SMALL = {"model": MODEL, "prompt": "And God said,", "max_tokens": 8, "temperature": 0, "ignore_eos": True}
BIG = 10 * 10**6  # a 10 MB prompt


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Server:
    def __init__(self, extra: list[str]):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "SPECMOE_API_KEY": KEY}
        self.args = ["serve", "--port", str(self.port), "--threads", "1", "--max-model-len", "1024",
                     "--max-waiting", "8", "--header-timeout", "0.5", "--body-timeout", "0.5", "--log-level",
                     "warning", *extra]
        self.p = subprocess.Popen([sys.executable, "-m", "specmoe", *self.args], env=env, cwd=REPO,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        t0 = time.monotonic()
        while True:
            if self.p.poll() is not None:
                raise SystemExit(f"specmoe serve exited: {self.p.stderr.read()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() - t0 > 120:
                raise SystemExit("specmoe serve did not come up")
            time.sleep(0.2)

    def stop(self) -> str:
        self.p.send_signal(signal.SIGINT)
        try:
            _, err = self.p.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            self.p.kill()
            _, err = self.p.communicate()
        return err


SINK = r"""
import json, socketserver, sys
BODY = json.dumps({"error": {"message": "sink", "type": "invalid_request_error", "param": None,
                             "code": "request_too_large"}}).encode()
class H(socketserver.StreamRequestHandler):
    def handle(self):
        while True:
            head = b""
            while b"\r\n\r\n" not in head:
                chunk = self.request.recv(65536)
                if not chunk:
                    return
                head += chunk
            head, _, rest = head.partition(b"\r\n\r\n")
            n = next(int(x.split(b":")[1]) for x in head.split(b"\r\n") if x.lower().startswith(b"content-length"))
            left = n - len(rest)
            while left > 0:
                chunk = self.request.recv(min(left, 65536))
                if not chunk:
                    return
                left -= len(chunk)
            self.request.sendall(b"HTTP/1.1 413 Payload Too Large\r\ncontent-type: application/json\r\n"
                                 b"content-length: %d\r\n\r\n" % len(BODY) + BODY)
socketserver.ThreadingTCPServer.allow_reuse_address = True
srv = socketserver.ThreadingTCPServer(("127.0.0.1", int(sys.argv[1])), H)
srv.daemon_threads = True
srv.serve_forever()
"""


class Sink:
    """The control: a bare socket server that reads each request's body and answers 413, so the attackers' own
    cost (and the machine's) shows without specmoe's server handling the 10 MB requests."""

    def __init__(self):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.p = subprocess.Popen([sys.executable, "-c", SINK, str(self.port)])
        t0 = time.monotonic()
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() - t0 < 30, "the sink did not come up"
                time.sleep(0.1)

    def stop(self):
        self.p.kill()
        self.p.wait()


def timed(fn) -> tuple[float, object]:
    t = time.perf_counter()
    out = fn()
    return time.perf_counter() - t, out


def health(url: str) -> float:
    dt, r = timed(lambda: httpx.get(url + "/health", timeout=60))
    assert r.status_code == 200, r.text
    return dt


def small(url: str) -> float:
    dt, r = timed(lambda: httpx.post(url + "/v1/completions", json=SMALL, headers=AUTH, timeout=120))
    assert r.status_code == 200, r.text
    return dt


def attacker(url: str, starts: list[float], out) -> None:
    """One hostile client (its own process, so its work on 10 MB bodies takes no GIL from the measuring
    clients): a 10 MB completion at each of `starts` (time.time()), reported as (start, end, status, code)."""
    body = json.dumps({"model": MODEL, "prompt": "word " * (BIG // 5), "max_tokens": 4}).encode()
    headers = {**AUTH, "Content-Type": "application/json"}
    with httpx.Client(timeout=120) as http:
        for t0 in starts:
            time.sleep(max(0.0, t0 - time.time()))
            t = time.time()
            try:
                r = http.post(url + "/v1/completions", content=body, headers=headers)
                out.put((t, time.time(), r.status_code, r.json()["error"]["code"] if r.status_code != 200 else None))
            except httpx.HTTPError as e:
                out.put((t, time.time(), None, repr(e)))


def attack(url: str, pid: int, rounds: int, period: float, target: str | None = None) -> dict:
    """Idle latencies; then `rounds` times (every `period` s) three clients (processes) send a 10 MB completion
    at once, while this process polls /health every 50 ms and sends small completions back to back. The
    latencies reported under attack are those of the requests in flight while a 10 MB request was; RSS is
    read before and 2 s after. `target`: where the attackers send (default: `url`; the control: a sink)."""
    import multiprocessing as mp
    import queue
    for _ in range(2):  # warm up
        small(url)
    idle_health = [health(url) for _ in range(10)]
    idle_small = [small(url) for _ in range(5)]
    rss0 = rss_mb(pid)
    samples = {"health": [], "small": []}  # (start, end) wall-clock
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    first = time.time() + 3.0  # spawned interpreters take a moment to come up
    starts = [first + k * period for k in range(rounds)]
    procs = [ctx.Process(target=attacker, args=(target or url, starts, q)) for _ in range(3)]
    for p in procs:
        p.start()
    stop = threading.Event()

    def poll(kind, fn, pause):
        while not stop.is_set():
            t = time.time()
            fn(url)
            samples[kind].append((t, time.time()))
            time.sleep(pause)
    pollers = [threading.Thread(target=poll, args=("health", health, 0.05)),
               threading.Thread(target=poll, args=("small", small, 0.0))]
    for t in pollers:
        t.start()
    bigs = []
    while len(bigs) < 3 * rounds and (any(p.is_alive() for p in procs) or not q.empty()):
        try:
            bigs.append(q.get(timeout=0.2))
        except queue.Empty:
            pass
    stop.set()
    for t in pollers + procs:
        t.join()
    time.sleep(2)
    rss1 = rss_mb(pid)

    def overlapping(kind):  # latencies of the samples in flight while some 10 MB request was
        return [e - s for s, e in samples[kind] if any(s < be and bs < e for bs, be, *_ in bigs)]
    under_health, under_small = overlapping("health"), overlapping("small")
    med_small = statistics.median(idle_small)
    statuses = {}
    for *_, status, code in bigs:
        key = f"{status} {code or ''}".strip()
        statuses[key] = statuses.get(key, 0) + 1
    big_s = [e - s for s, e, *_ in bigs]
    return {"idle_health_s_median": round(statistics.median(idle_health), 4),
            "idle_small_completion_s_median": round(med_small, 4),
            "rounds": rounds, "period_s": period,
            "big_requests": len(bigs), "big_request_statuses": statuses,
            "big_request_s_median": round(statistics.median(big_s), 3), "big_request_s_max": round(max(big_s), 3),
            "under_attack_health_s_max": round(max(under_health), 4),
            "under_attack_health_s_median": round(statistics.median(under_health), 4),
            "under_attack_health_samples": len(under_health),
            "under_attack_small_completion_s_max": round(max(under_small), 4),
            "under_attack_small_completion_s_median": round(statistics.median(under_small), 4),
            "under_attack_small_completion_samples": len(under_small),
            "small_completion_slowdown_median": round(statistics.median(under_small) / med_small, 2),
            "small_completion_slowdown_max": round(max(under_small) / med_small, 2),
            "rss_mb_before": round(rss0, 1), "rss_mb_after": round(rss1, 1), "rss_growth_mb": round(rss1 - rss0, 1)}


# ----------------------------------------------------------------------------- hostile cases
def raw(url: str, data: bytes, *, pace: float | None = None, timeout: float = 10) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as c:
        try:
            if pace is None:
                c.sendall(data)
            else:
                for b in data:
                    c.sendall(bytes([b]))
                    time.sleep(pace)
        except OSError:  # the server closed it mid-send: read what it said
            pass
        out = b""
        try:
            while chunk := c.recv(65536):
                out += chunk
        except ConnectionResetError:
            pass
    return out


def parse_raw(out: bytes) -> tuple[int | None, dict, bytes]:
    if not out:
        return None, {}, b""
    head, _, body = out.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (x.split(":", 1) for x in lines[1:] if ":" in x)}
    return int(lines[0].split()[1]), headers, body


def openai_body(body: bytes) -> bool:
    try:
        err = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}


def http_case(method: str, url: str, **kw):
    def run():
        r = httpx.request(method, url, timeout=30, **kw)
        return r.status_code, dict(r.headers), r.content
    return run


def raw_case(url: str, data: bytes, **kw):
    def run():
        status, headers, body = parse_raw(raw(url, data, **kw))
        return status, headers, body
    return run


def hostile_cases(url: str) -> list[dict]:
    post = f"{url}/v1/completions"
    jh = {**AUTH, "Content-Type": "application/json"}
    stream_body = json.dumps({**SMALL, "stream": True}).encode()

    def chunked():
        for _ in range(160):
            yield b"x" * 65536

    def idle_connections():
        host, port = url.removeprefix("http://").split(":")
        socks = [socket.create_connection((host, int(port)), timeout=10) for _ in range(30)]
        closed = sum(s.recv(10) == b"" for s in socks)
        for s in socks:
            s.close()
        return (200 if closed == 30 else 500), {}, json.dumps({"closed": closed}).encode()

    def disconnect_mid_body():
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port))) as c:
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n{\"prompt\": \"")
            time.sleep(0.1)
        r = httpx.get(url + "/health", timeout=10)
        return r.status_code, dict(r.headers), r.content

    cases = [  # (name, expected status, run, check)
        ("10 MB body (Content-Length)", 413,
         http_case("POST", post, content=b'{"prompt": "' + b"a" * BIG + b'"}', headers=jh), None),
        ("10 MB ignored field", 413,
         http_case("POST", post, json={**SMALL, "user": "u" * BIG}, headers=AUTH), None),
        ("10 MB chunked body (no Content-Length)", 413, http_case("POST", post, content=chunked(), headers=jh), None),
        ("10 GB declared, Expect: 100-continue", 413,
         raw_case(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 10000000000\r\n"
                       b"Expect: 100-continue\r\n\r\n"), None),
        ("1 MB prompt (over the context by its characters)", 400,
         http_case("POST", post, json={**SMALL, "prompt": "word " * 200_000}, headers=AUTH), None),
        ("1,000-prompt list (max_waiting 8)", 400,
         http_case("POST", post, json={**SMALL, "prompt": ["x"] * 1000}, headers=AUTH), None),
        ("n=9 (max_waiting 8)", 400, http_case("POST", post, json={**SMALL, "n": 9}, headers=AUTH), None),
        ("deeply nested JSON (1 MB of '[')", 400, http_case("POST", post, content=b"[" * 10**6, headers=jh), None),
        ("GET on a POST route", 405, http_case("GET", post, headers=AUTH),
         lambda h, b: h.get("allow") == "POST"),
        ("HEAD /health", 200, http_case("HEAD", url + "/health"), lambda h, b: b == b""),
        ("no API key", 401, http_case("POST", post, json=SMALL), None),
        ("temperature 1e-45", 200, http_case("POST", post, json={**SMALL, "temperature": 1e-45}, headers=AUTH),
         lambda h, b: json.loads(b)["usage"]["completion_tokens"] == 8),
        ("HTTP/1.0 stream", 200,
         raw_case(url, b"POST /v1/completions HTTP/1.0\r\nAuthorization: Bearer " + KEY.encode() +
                  b"\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(stream_body) +
                  stream_body),
         lambda h, b: "transfer-encoding" not in h and b.rstrip().endswith(b"data: [DONE]")),
        ("malformed request line", 400, raw_case(url, b"NOT HTTP\r\n\r\n"), None),
        ("bad Content-Length", 400,
         raw_case(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: ten\r\n\r\n"), None),
        ("headers byte by byte (20 ms/byte)", 408,
         raw_case(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: 2\r\n\r\n{}", pace=0.02), None),
        ("body stalls after 3 of 100 bytes", 408,
         raw_case(url, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"a"), None),
        ("30 idle connections (all closed)", 200, idle_connections, None),
        ("client gone mid-body, then /health", 200, disconnect_mid_body, None),
    ]
    out = []
    for name, want, run, check in cases:
        dt, (status, headers, body) = timed(run)
        rec = {"case": name, "status": status, "expected": want, "s": round(dt, 3)}
        if want >= 400:
            rec["openai_body"] = openai_body(body)
        if check is not None:
            rec["check"] = bool(check({k.lower(): v for k, v in headers.items()}, body))
        rec["ok"] = status == want and rec.get("openai_body", True) and rec.get("check", True)
        out.append(rec)
    return out


def commit() -> dict:
    def git(*a):
        return subprocess.run(["git", *a], cwd=REPO, capture_output=True, text=True).stdout.strip()
    return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=10, help="rounds of three concurrent 10 MB requests")
    ap.add_argument("--period", type=float, default=1.0, help="seconds between the rounds' starts")
    ap.add_argument("--scenarios", default="default,big-bodies,control")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "serve_hostile.json"))
    args = ap.parse_args()
    scenarios = {"default": [], "big-bodies": ["--max-body-size", "64MiB"], "control": []}
    result = {**commit(), "machine": {"python": platform.python_version(), "cpus": os.cpu_count(),
                                      "platform": platform.platform(),
                                      "load_average_at_start": [round(x, 2) for x in os.getloadavg()]},
              "targets": {"health_s": 0.5, "small_completion_slowdown": 2.0, "rss_growth_mb": 200,
                          "hostile_case_s": 1.0},
              "scenarios": {}}
    for name in args.scenarios.split(","):
        srv = Server(scenarios[name])
        sink = Sink() if name == "control" else None
        try:
            rec = {"server_args": srv.args, **attack(srv.url, srv.p.pid, args.rounds, args.period,
                                                     sink.url if sink else None)}
            if name == "default":
                rec["hostile_cases"] = hostile_cases(srv.url)
            rec["rss_mb_end"] = round(rss_mb(srv.p.pid), 1)
        finally:
            err = srv.stop()
            if sink is not None:
                sink.stop()
        rec["server_stderr_lines"] = [x for x in err.splitlines() if x.strip()][-20:]
        rec["server_stderr_tracebacks"] = err.count("Traceback")
        result["scenarios"][name] = rec
        print(f"\n== {name}: {' '.join(srv.args)}")
        for k, v in rec.items():
            if k not in ("hostile_cases", "server_args", "server_stderr_lines"):
                print(f"  {k}: {v}")
        for c in rec.get("hostile_cases", []):
            print(f"  {'ok ' if c['ok'] else 'BAD'} {c['status']} in {c['s']:6.3f} s  {c['case']}")
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
