"""What a switch between `auto`'s arms costs its next steps: `auto` driven through a fixed schedule of arm runs.

    .venv/bin/python benchmarks/auto_switch.py [--model demo] [--dtype bfloat16] [--batch 1] [--requests 64]
        [--schedule eagle-g4:16,eagle-g2:8,eagle-g2:16,eagle-g4:8,eagle-g4:16,plain:8]
        [--out benchmarks/results/auto_switch_demo_bf16.json]

`auto` measures an arm by trials of a few steps right after a switch to it, and drops only the first of them (it
pays the switch's cold cache). Whether the next steps still pay it decides whether a trial's rate is the arm's:
here `auto`'s pick is replaced by a schedule (arm:steps runs, repeated; a fresh plan every step, so every step is
the scheduled arm's) and each step `auto` records (`ArmRates.record`, wrapped for the run: the credited and emitted
tokens, seconds, expert wait and lookups it rates the arm by) is binned by its position in its run: step 1 (the
switch), 2, 3, 4, 5-8, 9-16. Steps of rows in their first tokens (`YOUNG`) are left out, as `auto` leaves them
out of every window. Disk tier, expert cache at 25% of the experts per layer, greedy, held-out warm-up prompts,
`--max-tokens` tokens a request. One process, one engine: rates between bins share its moments.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from auto_bench import commit, disk_tier, prompts_for  # noqa: E402
from specmoe import LLM  # noqa: E402
from specmoe.bench.machine import machine_info  # noqa: E402
from specmoe.bench.measure import measure  # noqa: E402
from specmoe.decoding.control.measured import Pick  # noqa: E402
from specmoe.engine.auto import controller_of  # noqa: E402

BINS = ((1, "1"), (2, "2"), (3, "3"), (4, "4"), (8, "5-8"), (16, "9-16"))


def binned(k: int) -> str | None:
    return next((name for top, name in BINS if k <= top), None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo", choices=("demo", "widened"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--schedule", default="eagle-g4:16,eagle-g2:8,eagle-g2:16,eagle-g4:8,eagle-g4:16,plain:8")
    ap.add_argument("--cache-dir", default="/tmp/specmoe-auto-switch")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    tag = {"bfloat16": "bf16", "float32": "fp32"}.get(args.dtype, args.dtype)
    out = Path(args.out or REPO / "benchmarks" / "results" / f"auto_switch_{args.model}_{tag}.json")
    torch.set_num_threads(1)
    cache = Path(args.cache_dir)
    path, _, tok, tier = disk_tier(args.model, cache, args.dtype)
    llm = LLM(str(path), threads=1, dtype=args.dtype, decoding="auto", **tier)
    ctl = controller_of(llm)
    m = ctl.measured
    ctl.coast_max = ctl.coast_steps = ctl.coast_settled = 1  # a fresh plan (a pick) every step
    runs = [(a, int(n)) for a, n in (x.split(":") for x in args.schedule.split(","))]
    sched = [a for a, n in runs for _ in range(n)]
    pick, record = m.pick, m.record
    log, run = [], {"arm": None, "k": 0}

    def scheduled(arms, B, young=False):
        pick(arms, B, young)  # (its bookkeeping runs; its choice is replaced)
        want = sched[m.steps % len(sched)]
        return Pick(want if want in {a.name for a in arms} else "plain", "measured")

    def recorded(arm, B, tokens, seconds, step, expected=None, wait=0.0, lookups=0, choice=True, young=False):
        if choice:
            run["k"] = run["k"] + 1 if arm == run["arm"] else 1
            run["arm"] = arm
            if not young:
                log.append({"arm": arm, "k": run["k"], "tokens": float(tokens), "credited": float(expected or tokens),
                            "seconds": float(seconds), "wait": float(wait), "lookups": int(lookups)})
        return record(arm, B, tokens, seconds, step, expected, wait, lookups, choice, young)
    m.pick, m.record = scheduled, recorded
    pool = prompts_for(tok, args.requests, warmup=True)
    for i in tqdm(range(0, len(pool) - args.batch + 1, args.batch), desc="requests"):
        measure(llm, pool[i:i + args.batch], args.max_tokens, instrument=False)
    bins = {}
    for e in log:
        b = binned(e["k"])
        if b is not None:
            bins.setdefault(e["arm"], {}).setdefault(b, []).append(e)
    table = {arm: {b: {"steps": len(es),
                       "credited_tok_s": sum(e["credited"] for e in es) / sum(e["seconds"] for e in es),
                       "emitted_tok_s": sum(e["tokens"] for e in es) / sum(e["seconds"] for e in es),
                       "median_ms_per_step": 1e3 * statistics.median(e["seconds"] for e in es),
                       "wait_us_per_lookup": 1e6 * sum(e["wait"] for e in es) / max(1, sum(e["lookups"] for e in es))}
                   for b, es in sorted(by.items(), key=lambda kv: [n for _, n in BINS].index(kv[0]))}
             for arm, by in sorted(bins.items())}
    res = {"command": "python " + " ".join(sys.argv), "commit": commit(), "machine": machine_info(),
           "model": args.model, "dtype": args.dtype, "batch": args.batch, "requests": args.requests,
           "max_tokens": args.max_tokens, "schedule": args.schedule, "by_steps_since_switch": table,
           "out": str(out.relative_to(REPO)) if out.is_relative_to(REPO) else str(out)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    for arm, by in table.items():
        print(arm, "  ".join(f"[{b}] {v['credited_tok_s']:.1f} tok/s ({v['steps']})" for b, v in by.items()))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
