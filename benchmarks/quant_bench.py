"""Quantized expert storage on the disk tier: LRU with bf16 (the checkpoint's), int8 and int4 experts,
batch 1, equal cache slots, measured back to back in one run on the widened model (~6 MiB bf16 experts).

    python benchmarks/quant_bench.py [--slots 8] [--tokens 32] [--prompts 4] [--rounds 2] [--out FILE]

Each configuration gets a fresh LLM (cold cache), one warm-up request, then the measured requests one at
a time (batch 1, greedy). Reported per run: decode tok/s (decode steps / decode time), bytes moved per
generated token, hit rate, fetch wait; and the ratios of int8 / int4 against bf16 (median over rounds).
The widened model is built once under /tmp/wide (specmoe.bench.widen), its repacks under /tmp/wide-formats.
Writes benchmarks/results/quant_bench.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specmoe import LLM, SamplingParams  # noqa: E402
from specmoe.bench.machine import provenance  # noqa: E402
from specmoe.bench.widen import widened_copy  # noqa: E402
from specmoe.engine.llm import default_model_path  # noqa: E402
from specmoe.eval.perplexity import load_texts  # noqa: E402

FORMATS = ("checkpoint", "int8", "int4")


def run_one(model: Path, fmt: str, prompts: list[str], warm: str, args, depth: int = 1) -> dict:
    """One configuration on a fresh LLM (cold cache): a warm-up request, then `prompts` one at a time (batch 1,
    greedy). `tokens` (the generated ids) is for equality checks; drop it before writing results."""
    llm = LLM(model, offload="disk", cache_policy="lru", cache_experts=args.slots, expert_format=fmt,
              repack_dir=args.repack_dir, io_depth=depth, progress=True)
    params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)
    llm.generate([warm], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    llm.store.evict_all()
    llm.reset_stats()
    t0 = time.perf_counter()
    tokens = [llm.generate([p], params)[0].token_ids for p in prompts]  # batch 1
    wall = time.perf_counter() - t0
    s = llm.stats
    out = {"expert_format": s["expert_format"], "dtype": str(llm.dtype).replace("torch.", ""),
           "bytes_per_expert": s["bytes_per_expert"], "cache_slots_per_layer": s["cache_slots_per_layer"],
           "generated_tokens": s["generated_tokens"], "decode_steps": s["decode_steps"],
           "decode_time_s": s["decode_time_s"], "decode_tok_s": s["decode_steps"] / s["decode_time_s"],
           "wall_s": wall, "bytes_moved": s["bytes_moved"], "bytes_per_token": s["bytes_moved"] / s["generated_tokens"],
           "hit_rate": s["hit_rate"], "fetches": s["fetches"], "fetch_wait_s": s["fetch_wait_s"],
           "io_read_s": s.get("io_read_s"), "direct_io": s["direct_io"], "io_depth": s["io_depth"],
           "io_reads": s["io_reads"], "io_max_inflight": s["io_max_inflight"], "tokens": tokens}
    llm.close()
    return out


def add_args(ap: argparse.ArgumentParser, out: str) -> None:
    """The workload options this bench shares with io_depth_bench.py."""
    ap.add_argument("--slots", type=int, default=8, help="cache slots per MoE layer (equal for every format)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repack-dir", default="/tmp/wide-formats")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / out))


def workload(args) -> tuple[Path, list[str], str]:
    """The widened model (built once under /tmp/wide), the measured prompts and the warm-up prompt."""
    model, _ = widened_copy(default_model_path(), cache_dir="/tmp/wide", expert_mb=6.0)
    texts = load_texts(per_domain=1 + args.prompts // 4)
    return model, [t[:200] for t in texts[1:args.prompts + 1]], texts[0][:100]


def write(args, model: Path, prompts: list[str], runs: list[dict], summary: dict) -> None:
    result = {"model": str(model), "system": "lru", "offload": "disk", "batch": 1, "slots": args.slots,
              "tokens_per_request": args.tokens, "requests": len(prompts), "rounds": args.rounds,
              "command": "python " + " ".join(sys.argv), "provenance": provenance(), "runs": runs, "summary": summary}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(summary, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(ap, "quant_bench.json")
    args = ap.parse_args()
    model, prompts, warm = workload(args)
    for fmt in FORMATS:  # repack / quantize once, outside the measurements
        LLM(model, offload="disk", cache_experts=args.slots, expert_format=fmt, repack_dir=args.repack_dir,
            progress=True).close()
    runs = []
    for r in range(args.rounds):
        for fmt in FORMATS:
            res = run_one(model, fmt, prompts, warm, args)
            res.pop("tokens")  # formats round differently: no equality to check across them
            res["round"] = r
            runs.append(res)
            print(json.dumps({k: res[k] for k in ("round", "expert_format", "decode_tok_s", "bytes_per_token",
                                                    "hit_rate")}), flush=True)

    base = [x for x in runs if x["expert_format"] not in ("int8",) and not x["expert_format"].startswith("int4")]
    summary = {}
    for fmt in ("int8", "int4"):
        mine = [x for x in runs if x["expert_format"].startswith(fmt)]
        summary[fmt] = {
            "tok_s_vs_checkpoint": statistics.median(m["decode_tok_s"] / b["decode_tok_s"] for m, b in zip(mine, base)),
            "bytes_per_token_vs_checkpoint": statistics.median(m["bytes_per_token"] / b["bytes_per_token"]
                                                               for m, b in zip(mine, base)),
            "bytes_per_expert_vs_checkpoint": mine[0]["bytes_per_expert"] / base[0]["bytes_per_expert"]}
    write(args, model, prompts, runs, summary)


if __name__ == "__main__":
    main()
