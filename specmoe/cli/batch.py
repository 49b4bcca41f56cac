"""`specmoe batch INPUT OUTPUT`: offline batch inference over a JSONL or Parquet file on Ray workers
(specmoe.integrations), resumable; prints throughput and expert traffic."""
from __future__ import annotations

import sys

from specmoe.cli.common import (add_model_args, add_option_args, add_sampling_args, llm_kwargs, print_json,
                                sampling_kwargs)


def register(sub) -> None:
    p = sub.add_parser("batch", help="complete every row of a JSONL/Parquet file on Ray workers (resumable)",
                       description="Rows: {'prompt': text or token ids} or {'token_ids': [...]}, optional 'id' and "
                       "per-row max_tokens/temperature/top_k/top_p/seed/stop. OUTPUT (same formats, by extension) "
                       "gets one row per input row, in input order, with text, token_ids, finish_reason, stats "
                       "or an error. A rerun resumes from OUTPUT.partial / OUTPUT without redoing finished rows. "
                       "Needs the ray extra: pip install 'specmoe[ray]'.")
    p.add_argument("input", help="input rows: .jsonl or .parquet")
    p.add_argument("output", help="output rows: .jsonl or .parquet")
    p.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (e.g. HEAD:6379 or auto); default: start a local Ray instance")
    p.add_argument("--num-workers", type=int, default=1,
                   help="engines (Ray actors), each with its own expert cache and KV cache; 0 = one engine in this "
                        "process, without Ray")
    p.add_argument("--cpus-per-worker", type=int, default=1, help="CPUs reserved per worker (its torch threads "
                   "unless --threads is given)")
    p.add_argument("--gpus-per-worker", type=float, default=None, help="GPUs per worker (default: 1 with --device "
                   "cuda, else 0)")
    p.add_argument("--batch-size", type=int, default=None, help="rows per engine call (default: --max-batch)")
    g = p.add_argument_group("sampling defaults", "for rows that do not set the field themselves")
    add_sampling_args(g, per="row")
    p.add_argument("--json", action="store_true", help="print the summary as JSON (no progress bar)")
    add_model_args(p)
    add_option_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    from specmoe.integrations.offline import run_batch
    llm = llm_kwargs(args)
    defaults = sampling_kwargs(args)
    gpus = args.gpus_per_worker if args.gpus_per_worker is not None else float(args.device.startswith("cuda"))
    s = run_batch(args.input, args.output, llm=llm, defaults=defaults, num_workers=args.num_workers,
                  ray_address=args.ray_address, batch_size=args.batch_size, cpus_per_worker=args.cpus_per_worker,
                  gpus_per_worker=gpus, progress=not args.json)
    if args.json:
        print_json(s)
    else:
        sys.stderr.write(summary(s, args.output) + "\n")
    return 0


def summary(s: dict, output) -> str:
    parts = [f"{s['rows']} rows in {output}", f"{s['processed']} processed now ({s['resumed']} from an earlier run)"]
    if s["errors"]:
        parts.append(f"{s['errors']} error rows, e.g. {s['error_examples'][0]}")
    where = f"{s['num_workers']} Ray worker(s)" if s["num_workers"] else "this process"
    parts.append(f"{s['rows_per_s']:.1f} rows/s, {s['tokens_per_s']:.1f} tok/s on {where}")
    parts.append(f"experts moved {s['expert_bytes'] / 2**20:.1f} MiB ({s['expert_bytes_per_token'] / 2**10:.1f} "
                 "KiB/token)")
    for name, w in sorted(s["workers"].items()):
        parts.append(f"{name}: {w['rows']} rows, {w['expert_bytes_per_token'] / 2**10:.1f} KiB/token")
    if s["tokens_per_step"] is not None:
        parts.append(f"tokens/step {s['tokens_per_step']:.2f}")
    return "[" + "; ".join(parts) + "]"
