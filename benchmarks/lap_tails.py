"""What a closed batch's ragged tail costs each fixed draft length, against the spread `auto` prices it by.

    .venv/bin/python benchmarks/lap_tails.py [--model demo] [--batch 64] [--rounds 6] [--max-tokens 32]
        [--dtype float32] [--drafter eagle] [--gammas 1,2,3,4] [--out benchmarks/results/lap_tails_demo_fp32.json]

Fixed speculative engines (the drafter at each draft length, and plain decoding), disk tier with the expert cache
at 25% of the experts per layer, greedy, EOS ignored, every row `--max-tokens` tokens: rounds of one closed batch
each on held-out prompts (the first round warms caches and is not counted), the engines interleaved. Per engine:
its *full* steps (as many rows as the batch) and its whole batches, in tokens/s; the lap factor (whole ÷ full: what
the tail leaves) and its loss (1 − factor); the realized spread of a row's tokens per step (σ/√μ over its rows'
steps, `laps.spread`'s quantity as the rows realized it). `auto` prices an arm with no batches of its own at a
bucket by a tail loss fitted as proportional to the spread (`control/laps.py`): the ratios of the losses against the
ratios of the spreads say how far that holds. Steps are observed where the engine calls its decoding strategy
(`SpeculativeDecoder.step` / `AutoregressiveDecoder.step`, wrapped for the run: the rows and tokens of each step).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402

from auto_bench import commit, disk_tier, prompts_for  # noqa: E402
from specmoe import LLM  # noqa: E402
from specmoe.bench.machine import machine_info  # noqa: E402
from specmoe.bench.measure import measure  # noqa: E402
from specmoe.decoding.strategies import autoregressive, speculative  # noqa: E402


def observe(log: list, tag: list):
    """Wrap both decoders' `step` so each step appends (engine, round, rows, [tokens per row], seconds) to log."""
    undo = []
    for cls in (speculative.SpeculativeDecoder, autoregressive.AutoregressiveDecoder):
        orig = cls.step

        def step(self, inp, _orig=orig):
            t = time.perf_counter()
            out = _orig(self, inp)
            log.append((*tag[0], len(inp.seqs), [len(v) for v in out.tokens.values()], time.perf_counter() - t))
            return out
        cls.step = step
        undo.append((cls, orig))
    return lambda: [setattr(c, "step", o) for c, o in undo]


def summarize(steps: list, B: int) -> dict:
    tok = sum(sum(x[3]) for x in steps)
    sec = sum(x[4] for x in steps)
    full = [x for x in steps if x[2] == B]
    ftok, fsec = sum(sum(x[3]) for x in full), sum(x[4] for x in full)
    per_row = [t for x in steps for t in x[3]]
    mu, sd = statistics.mean(per_row), statistics.pstdev(per_row)
    factor = (tok / sec) / (ftok / fsec)
    return {"whole_tok_s": tok / sec, "full_tok_s": ftok / fsec, "factor": factor, "loss": 1.0 - factor,
            "steps_per_batch": len(steps), "full_steps_per_batch": len(full), "tokens_per_row_step": mu,
            "spread": sd / math.sqrt(mu)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo", choices=("demo", "widened"))
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--drafter", default="eagle")
    ap.add_argument("--gammas", default="1,2,3,4")
    ap.add_argument("--cache-dir", default="/tmp/specmoe-lap-tails")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.rounds < 2:
        ap.error("--rounds must be at least 2 (the first warms the caches and is not counted)")
    tag = {"bfloat16": "bf16", "float32": "fp32"}.get(args.dtype, args.dtype)
    out = Path(args.out or REPO / "benchmarks" / "results" / f"lap_tails_{args.model}_{tag}.json")
    torch.set_num_threads(1)
    cache = Path(args.cache_dir)
    path, _, tok, tier = disk_tier(args.model, cache, args.dtype)
    systems = {"plain": {"decoding": "ar"}}
    systems |= {f"{args.drafter}-g{g}": {"decoding": "specmoe", "drafter": args.drafter, "num_draft_tokens": int(g)}
                for g in args.gammas.split(",")}
    llms = {n: LLM(str(path), threads=1, dtype=args.dtype, **tier, **o) for n, o in systems.items()}
    pool = prompts_for(tok, args.batch * args.rounds, warmup=True)
    log, tag_now = [], [("", 0)]
    undo = observe(log, tag_now)
    t0 = time.perf_counter()
    try:
        for r in range(args.rounds):
            prompts = pool[r * args.batch:(r + 1) * args.batch]
            for n, llm in llms.items():
                tag_now[0] = (n, r)
                measure(llm, prompts, args.max_tokens, instrument=False)
            print(f"round {r + 1}/{args.rounds} done", flush=True)
    finally:
        undo()
    res = {n: summarize([x for x in log if x[0] == n and x[1] > 0], args.batch) for n in systems}
    ref = f"{args.drafter}-g{args.gammas.split(',')[0]}"
    for n, v in res.items():
        if n != "plain" and res[ref]["loss"] > 0 and res[ref]["spread"] > 0:
            v["loss_vs_first"] = v["loss"] / res[ref]["loss"]
            v["spread_vs_first"] = v["spread"] / res[ref]["spread"]
    doc = {"command": "python " + " ".join(sys.argv), "commit": commit(), "machine": machine_info(),
           "model": args.model, "dtype": args.dtype, "batch": args.batch, "rounds_counted": args.rounds - 1,
           "max_tokens": args.max_tokens, "tier": "disk", "elapsed_s": time.perf_counter() - t0,
           "first": ref, "engines": res}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    for n, v in res.items():
        print(f"{n:10s} full {v['full_tok_s']:8.1f} tok/s  whole {v['whole_tok_s']:8.1f}  factor {v['factor']:.3f}  "
              f"spread {v['spread']:.3f}" + (f"  loss ÷ {ref} {v['loss_vs_first']:.2f}, spread ÷ {ref} "
                                             f"{v['spread_vs_first']:.2f}" if "loss_vs_first" in v else ""))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
