"""`specmoe batch` on Ray Data against `LLM.generate` in one process: rows/s, tokens/s and expert bytes per
generated token (in total and per worker) on the demo model. Not a test.

    .venv/bin/python benchmarks/ray_bench.py [--rows 480] [--max-tokens 32] [--batch-size 64]
        [--prompt-tokens 32] [--workers 1,2] [--repeat 2] [--out benchmarks/results/ray_bench.json]

Runs back to back in one invocation, on the same rows (the bundled prompts as token ids, cut to
--prompt-tokens, domains interleaved), greedy, fp32, experts on the host tier behind an 8-slot LRU
cache per MoE layer (so there is expert traffic to count):
- generate: one LLM (max_batch = --batch-size, 1 thread) and one `generate` call over every row;
- generate-2threads: the same with 2 threads (the CPUs two workers get, in one engine);
- batch-in-process: `specmoe batch --num-workers 0` (the predictor in this process, one call per batch);
- ray-N: `specmoe batch --num-workers N` on a local Ray instance (1 CPU and 1 thread per worker).
Ray rows/s are end to end: from handing the rows to Ray Data to the last row back, so they include
starting the workers and loading one engine in each (`first_batch_s` shows how much of it that is).
Every run's token ids are compared with the first run's (`equal_to_first_run`). The systems run --repeat
rounds, every other round in reverse order; the medians are reported. The machine's load average is
recorded with each run: on a small shared machine, workers compete with everything else for cores.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from specmoe import LLM, SamplingParams  # noqa: E402
from specmoe.bench.machine import provenance  # noqa: E402
from specmoe.engine.llm import default_model_path  # noqa: E402
from specmoe.tokenizer import Tokenizer  # noqa: E402
from specmoe.integrations import ray as rx  # noqa: E402
from specmoe.integrations.offline import run_batch  # noqa: E402

ENGINE = {"dtype": "float32", "offload": "host", "cache_experts": 8, "cache_policy": "lru"}


def rows_of(n: int, prompt_tokens: int) -> list[dict]:
    tok = Tokenizer.load(default_model_path())
    files = sorted((REPO / "benchmarks" / "prompts").glob("*.jsonl"))
    per = [[json.loads(line) for line in f.read_text().splitlines() if line.strip()] for f in files]
    rows = [{"id": r["id"], "token_ids": tok.encode(r["prompt"])[:prompt_tokens]} for g in zip(*per) for r in g]
    return (rows * (n // len(rows) + 1))[:n]


def run_generate(rows, args, threads: int) -> tuple[dict, list]:
    n = torch.get_num_threads()
    t0 = time.perf_counter()
    llm = LLM(max_batch=args.batch_size, threads=threads, **ENGINE)
    load_s = time.perf_counter() - t0
    t1 = time.perf_counter()
    outs = llm.generate([r["token_ids"] for r in rows], SamplingParams(max_tokens=args.max_tokens))
    wall = time.perf_counter() - t1
    s = llm.stats
    llm.close()
    torch.set_num_threads(n)
    gen = s["generated_tokens"]
    return ({"rows": len(rows), "wall_s": wall, "load_s": load_s, "rows_per_s": len(rows) / wall,
             "tokens_per_s": gen / wall, "generated_tokens": gen, "expert_bytes": s["bytes_moved"],
             "expert_bytes_per_token": s["bytes_moved"] / gen, "hit_rate": s["hit_rate"]},
            [o.token_ids for o in outs])


def run_rows(src: Path, tmp: Path, args, workers: int) -> tuple[dict, list]:
    dst = tmp / f"out-{workers}.jsonl"
    dst.unlink(missing_ok=True)  # a complete output from an earlier round would be resumed: nothing to do
    t0 = time.perf_counter()
    s = run_batch(src, dst, llm={**ENGINE, "max_batch": args.batch_size, "threads": 1},
                  defaults={"max_tokens": args.max_tokens}, num_workers=workers, batch_size=args.batch_size,
                  progress=False)
    s["total_s"] = time.perf_counter() - t0
    assert s["resumed"] == 0 and s["processed"] == s["rows"]
    out = [json.loads(line)["token_ids"] for line in dst.read_text().splitlines()]
    return s, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=480)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--workers", default="1,2")
    ap.add_argument("--repeat", type=int, default=2, help="rounds; every other round runs the systems in "
                    "reverse order, so drifting machine load does not favour one side")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "ray_bench.json"))
    args = ap.parse_args(argv)
    workers = [int(w) for w in args.workers.split(",")]
    rows = rows_of(args.rows, args.prompt_tokens)
    res = {"command": "python " + " ".join(sys.argv), "provenance": provenance(),
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
                       "load_avg_start": os.getloadavg()},
           "settings": {**vars(args), "engine": ENGINE}, "runs": {}}
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        src = tmp / "rows.jsonl"
        src.write_text("".join(json.dumps(r) + "\n" for r in rows))
        t0 = time.perf_counter()
        rx.connect(num_cpus=max(os.cpu_count() or 1, max(workers)))
        res["ray_init_s"] = time.perf_counter() - t0
        systems = {"generate": lambda: run_generate(rows, args, threads=1),
                   "generate-2threads": lambda: run_generate(rows, args, threads=2),
                   "batch-in-process": lambda: run_rows(src, tmp, args, 0),
                   **{f"ray-{w}": (lambda w=w: run_rows(src, tmp, args, w)) for w in workers}}
        ref = None
        try:
            for k in range(args.repeat):
                for name in (list(systems) if k % 2 == 0 else list(systems)[::-1]):
                    r, out = systems[name]()
                    ref = out if ref is None else ref
                    r["equal_to_first_run"] = out == ref
                    r["load_avg_1min"] = os.getloadavg()[0]
                    res["runs"].setdefault(name, []).append(r)
        finally:
            rx.shutdown()
    res["machine"]["load_avg_end"] = os.getloadavg()
    res["median"] = {name: {k: statistics.median(r[k] for r in runs)
                            for k in ("rows_per_s", "tokens_per_s", "expert_bytes_per_token")}
                     for name, runs in res["runs"].items()}
    for name, runs in res["runs"].items():
        per = [round(w["expert_bytes_per_token"] / 1024, 1) for r in runs for w in r.get("workers", {}).values()]
        m = res["median"][name]
        print(f"{name:18s} {m['rows_per_s']:7.1f} rows/s {m['tokens_per_s']:8.1f} tok/s "
              f"{m['expert_bytes_per_token'] / 1024:6.1f} KiB/token (median of {len(runs)})"
              + (f"; per worker KiB/token {per}" if per else "")
              + (f"; first batch after {[round(r['first_batch_s'], 1) for r in runs]} s" if "first_batch_s" in runs[0]
                 else ""))
    print(f"wrote {args.out}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
