"""Disk reads in flight (`io_depth`): LRU on the disk tier at batch 1, bf16 (the checkpoint's) and int8 experts,
io_depth 1 / 2 / 4, measured back to back (alternating, `--rounds` times) on the widened model (~6 MiB bf16
experts, ~3 MiB int8).

    python benchmarks/io_depth_bench.py [--slots 8] [--tokens 32] [--prompts 4] [--rounds 2] [--depths 1 2 4]

Each configuration gets a fresh LLM (cold cache), one warm-up request, then the measured requests one at a time
(greedy). Reported per run: decode tok/s (decode steps / decode time), fetch wait, the disk's read seconds
(summed over reads) and the most reads seen in flight at once; the summary gives, per format, the median tok/s of
each depth over depth 1 and int8 over bf16 at each depth. Writes benchmarks/results/io_depth.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from quant_bench import add_args, run_one, workload, write  # noqa: E402

FORMATS = ("checkpoint", "int8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(ap, "io_depth.json")
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 2, 4])
    args = ap.parse_args()
    model, prompts, warm = workload(args)
    runs = []
    for r in range(args.rounds):
        for fmt in FORMATS:
            for depth in args.depths:
                res = run_one(model, fmt, prompts, warm, args, depth)
                res["round"] = r
                runs.append(res)
                print(json.dumps({k: v for k, v in res.items() if k != "tokens"}), flush=True)
    same = all(x["tokens"] == runs[0]["tokens"] for x in runs if x["expert_format"] == runs[0]["expert_format"])
    for x in runs:
        x.pop("tokens")

    def tok_s(fmt_prefix, depth):
        return [x["decode_tok_s"] for x in runs if x["expert_format"].startswith(fmt_prefix) and x["io_depth"] == depth]

    summary = {"same_tokens_across_depths": same}
    for name, prefix in (("bf16", "bfloat16"), ("int8", "int8")):
        base = statistics.median(tok_s(prefix, args.depths[0]))
        summary[name] = {f"depth{d}_tok_s": statistics.median(tok_s(prefix, d)) for d in args.depths}
        summary[name].update({f"depth{d}_vs_depth{args.depths[0]}": statistics.median(tok_s(prefix, d)) / base
                              for d in args.depths[1:]})
    summary["int8_vs_bf16"] = {f"depth{d}": summary["int8"][f"depth{d}_tok_s"] / summary["bf16"][f"depth{d}_tok_s"]
                               for d in args.depths}
    write(args, model, prompts, runs, summary)


if __name__ == "__main__":
    main()
