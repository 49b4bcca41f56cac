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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specmoe import LLM, SamplingParams  # noqa: E402
from specmoe.bench.widen import widened_copy  # noqa: E402
from specmoe.engine.llm import default_model_path  # noqa: E402
from specmoe.eval.perplexity import load_texts  # noqa: E402

FORMATS = ("checkpoint", "int8")


def run_one(model: Path, fmt: str, depth: int, prompts: list[str], warm: str, args) -> dict:
    llm = LLM(model, offload="disk", cache_policy="lru", cache_experts=args.slots, expert_format=fmt,
              repack_dir=args.repack_dir, io_depth=depth)
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    llm.generate([warm], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    llm.provider.evict_all()
    llm.reset_stats()
    outs = [llm.generate([p], params)[0].token_ids for p in prompts]  # batch 1
    s = llm.stats
    llm.close()
    return {"expert_format": s["expert_format"], "io_depth": s["io_depth"], "decode_tok_s": s["decode_steps"] /
            s["decode_time_s"], "fetch_wait_s": s["fetch_wait_s"], "io_read_s": s["io_read_s"],
            "io_reads": s["io_reads"], "io_max_inflight": s["io_max_inflight"], "hit_rate": s["hit_rate"],
            "bytes_per_token": s["bytes_moved"] / s["generated_tokens"], "tokens": outs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--repack-dir", default="/tmp/wide-formats")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "io_depth.json"))
    args = ap.parse_args()
    model, _ = widened_copy(default_model_path(), cache_dir="/tmp/wide", expert_mb=6.0)
    texts = load_texts(per_domain=1 + args.prompts // 4)
    prompts, warm = [t[:200] for t in texts[1:args.prompts + 1]], texts[0][:100]
    runs = []
    for r in range(args.rounds):
        for fmt in FORMATS:
            for depth in args.depths:
                res = run_one(model, fmt, depth, prompts, warm, args)
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
    result = {"model": str(model), "system": "lru", "offload": "disk", "batch": 1, "slots": args.slots,
              "tokens_per_request": args.tokens, "requests": len(prompts), "rounds": args.rounds,
              "command": "python " + " ".join(sys.argv), "runs": runs, "summary": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
