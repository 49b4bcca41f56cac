"""Disk-tier rows on transparent huge pages against rows on 4 KiB pages, on the widened copy (~6 MiB experts).

    .venv/bin/python benchmarks/hugepage_io.py [--rounds 5] [--reads 60] [--batch 4] [--tokens 32] [--dtype float32]

Two measurements, each interleaved round by round within one process (the machine's noise moves whole runs by up
to 1.5x; ratios within a round do not carry it):
- reads: `DiskTier.read_into` (O_DIRECT `preadv` of one expert) of the same random experts into two rows on huge
  pages (`specmoe.memory.aligned_empty`, the engine's rows) and into two rows from the allocator (4 KiB pages),
  alternating rows as the tier's staging rows alternate; median microseconds per read;
- engine: four engines on the disk tier (s3fifo, cache 8 of 32 experts, no prefetch, plain decoding), two built as
  the engine builds them (huge-page rows) and two with every row taken from the allocator (4 KiB pages: the
  engine's rows as they were before they moved to huge pages). Decode tok/s per engine per round, and the A/A
  spread: how far apart the two identical engines of each kind run (what `benchmarks/auto_bench.py` calls its
  A/A floor).
Writes benchmarks/results/hugepage_io.json (with the kernel's THP mode, the process's AnonHugePages and the CPU).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import torch  # noqa: E402

from specmoe import LLM  # noqa: E402
from specmoe import memory  # noqa: E402
from specmoe.bench.machine import machine_info, provenance  # noqa: E402
from specmoe.bench.measure import measure  # noqa: E402
from specmoe.experts.repack import open_repack  # noqa: E402
from specmoe.experts.tiers import DiskTier  # noqa: E402
from specmoe.weights.checkpoint import Checkpoint  # noqa: E402


@contextlib.contextmanager
def small_rows():
    """A context in which the engine's rows come from the allocator (4 KiB pages): the control."""
    saved, memory._huge_mapping = memory._huge_mapping, lambda nbytes: None
    try:
        yield
    finally:
        memory._huge_mapping = saved


def anon_huge_kib() -> int | None:
    try:
        with open("/proc/self/smaps_rollup") as f:
            for line in f:
                if line.startswith("AnonHugePages:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def reads(model: Path, repack_dir: Path, rounds: int, n: int) -> dict:
    ck = Checkpoint(model)
    rp = open_repack(ck, torch.bfloat16, repack_dir)
    tier = DiskTier(rp, torch.bfloat16, direct=True)
    assert tier.direct_io, "the filesystem refuses O_DIRECT: nothing to measure"
    kinds = {k: [memory.aligned_empty(tier.stride, huge=k == "huge") for _ in range(2)] for k in ("huge", "4k")}
    ids = [(layer, e) for layer in ck.config.moe_layers for e in range(ck.config.num_experts)]
    rng = random.Random(0)
    per = {k: [] for k in kinds}
    for r in range(rounds):
        for k in (("huge", "4k") if r % 2 == 0 else ("4k", "huge")):
            rows, ts = kinds[k], []
            for i, (layer, e) in enumerate(rng.sample(ids, min(n, len(ids)))):
                t0 = time.perf_counter()
                tier.read_into(layer, e, rows[i % 2], verify=False)
                ts.append(time.perf_counter() - t0)
            per[k].append(1e6 * statistics.median(ts))
        print(f"reads round {r}: " + ", ".join(f"{k} {v[-1]:.0f} us" for k, v in per.items()), flush=True)
    tier.close()
    ratio = [a / b for a, b in zip(per["4k"], per["huge"])]
    return {"expert_bytes": tier.stride, "reads_per_round": n, "median_read_us": per,
            "4k_over_huge_per_round": ratio, "4k_over_huge_median": statistics.median(ratio)}


def engines(model: Path, repack_dir: Path, args) -> dict:
    from auto_bench import prompts_for
    torch.set_num_threads(1)
    kw = dict(threads=1, dtype=args.dtype, offload="disk", cache_experts=8, prefetch="none", cache_policy="s3fifo",
              decoding="ar", repack_dir=str(repack_dir))
    llms = {n: LLM(str(model), **kw) for n in ("huge-a", "huge-b")}
    with small_rows():
        llms.update({n: LLM(str(model), **kw) for n in ("4k-a", "4k-b")})
    tok = llms["huge-a"].tokenizer
    meas, warm = prompts_for(tok, args.batch), prompts_for(tok, args.batch, warmup=True)
    for llm in llms.values():
        measure(llm, warm, args.tokens, instrument=False)
    per = {n: [] for n in llms}
    read_us = {n: [] for n in llms}
    for r in range(args.rounds):
        order = list(llms)[r % 4:] + list(llms)[: r % 4]
        for n in order:
            x = measure(llms[n], meas, args.tokens, instrument=False)
            per[n].append(x["decode_tokens_per_s"])
            st = llms[n].stats
            read_us[n].append(1e6 * st["io_read_s"] / max(1, st["io_reads"]))
        print(f"engine round {r}: " + ", ".join(f"{n} {v[-1]:.1f}" for n, v in per.items()) + " tok/s", flush=True)
    rows = {n: {k: llm.stats[k] for k in ("host_rows_bytes", "host_rows_huge_bytes")} for n, llm in llms.items()}
    for llm in llms.values():
        llm.close()
    med = {n: statistics.median(v) for n, v in per.items()}

    def spread(a, b):
        return statistics.median([max(x, y) / min(x, y) for x, y in zip(per[a], per[b])])
    huge_over_4k = statistics.median([(per["huge-a"][i] + per["huge-b"][i]) / (per["4k-a"][i] + per["4k-b"][i])
                                      for i in range(args.rounds)])
    return {"batch": args.batch, "tokens": args.tokens, "dtype": args.dtype, "decode_tok_s": per,
            "median_tok_s": med, "read_us_per_round": read_us, "rows": rows,
            "aa_spread_huge": spread("huge-a", "huge-b"), "aa_spread_4k": spread("4k-a", "4k-b"),
            "huge_over_4k": huge_over_4k}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reads", type=int, default=60)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--cache-dir", type=Path, default=Path("/tmp/specmoe-auto-bench"),
                    help="where the widened copy and its repack live (auto_bench.py's default)")
    ap.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "hugepage_io.json")
    args = ap.parse_args()
    from specmoe.bench.widen import widened_copy
    from specmoe.engine.llm import default_model_path
    model = widened_copy(default_model_path(), cache_dir=args.cache_dir)[0]
    repack_dir = args.cache_dir / "repack"
    res = {"command": "python benchmarks/hugepage_io.py " + " ".join(sys.argv[1:]),
           "what": "disk-tier rows on transparent huge pages vs 4 KiB pages (widened copy)",
           "thp_mode": memory.huge_pages_mode(), "machine": machine_info(model), "provenance": provenance(),
           "reads": reads(model, repack_dir, args.rounds, args.reads), "engine": engines(model, repack_dir, args),
           "anon_huge_kib_at_end": anon_huge_kib()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    print(json.dumps({"reads_4k_over_huge": res["reads"]["4k_over_huge_median"],
                      "engine_huge_over_4k": res["engine"]["huge_over_4k"],
                      "aa_spread_huge": res["engine"]["aa_spread_huge"],
                      "aa_spread_4k": res["engine"]["aa_spread_4k"]}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
