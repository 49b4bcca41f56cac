"""Do the disk tier's reads overlap at io_depth > 1? Reads alone, no compute: every expert of every MoE layer of a
model's repack loaded through the engine's ExpertLoader + DiskTier (O_DIRECT, the CPU path: staged rows, checksum
and decode on the waiting thread) at each depth, the depths' order alternating round by round.

    python benchmarks/io_overlap_bench.py [--model demo|widened|PATH] [--rounds 3] [--depths 1 2 4]

Per run: wall seconds, summed per-read seconds (`io_read_s`: above the wall when reads overlap), the most reads seen
in flight at once, and MB/s (bytes read / wall). The summary gives medians per depth and each depth's MB/s over
depth 1's. `widened` is the ~6 MiB-expert copy io_depth_bench.py uses (built under /tmp/wide on first use). Writes
benchmarks/results/io_overlap_<model>.json (+ .png).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from specmoe.bench.machine import machine_info  # noqa: E402
from specmoe.bench.plots import write_results  # noqa: E402
from specmoe.engine.llm import default_model_path  # noqa: E402
from specmoe.experts.buffers import alloc_rows  # noqa: E402
from specmoe.experts.formats import ExpertShape, make_format  # noqa: E402
from specmoe.experts.loader import ExpertLoader  # noqa: E402
from specmoe.experts.repack import open_repack  # noqa: E402
from specmoe.experts.tiers import DiskTier  # noqa: E402
from specmoe.weights.checkpoint import Checkpoint  # noqa: E402


def model_path(name: str) -> Path:
    if name == "demo":
        return default_model_path()
    if name == "widened":
        from specmoe.bench.widen import widened_copy
        return widened_copy(default_model_path(), cache_dir="/tmp/wide", expert_mb=6.0)[0]
    return Path(name)


def one_run(rp, fmt, mc, depth: int) -> dict:
    tier = DiskTier(rp, fmt.dtype, queue_depth=depth)
    loader = ExpertLoader(tier, torch.device("cpu"), tier.stride)
    rows = alloc_rows(mc.num_experts, tier.stride, torch.device("cpu"))
    tier.reset_io_stats()
    t0 = time.perf_counter()
    for layer in mc.moe_layers:  # a layer's experts queued at once, as a forward's misses are
        futs = [loader.submit(layer, e, rows[e]) for e in range(mc.num_experts)]
        loader.flush()
        for f in futs:
            loader.wait(f)
    wall = time.perf_counter() - t0
    out = {"io_depth": depth, "wall_s": wall, "io_read_s": tier.read_s, "reads": tier.reads,
           "max_inflight": tier.max_inflight, "direct_io": tier.direct_io,
           "MB_s": tier.reads * tier.stored_bytes / wall / 1e6}
    loader.close()
    tier.close()
    return out


def draw(res, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(5, 3.5))
    d = res["depths"]
    ax.bar([str(x) for x in d], [res["summary"][f"depth{x}"]["MB_s"] for x in d])
    ax.set_xlabel("io_depth (reads in flight)")
    ax.set_ylabel("MB/s (median)")
    ax.set_title(f"disk tier reads alone, {res['bytes_per_expert'] / 2**20:.2f} MiB experts")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="widened")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--depths", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    path = model_path(args.model)
    ck = Checkpoint(path)
    mc = ck.config
    fmt = make_format("checkpoint", ExpertShape.of(mc), ck.storage_dtype)
    rp = open_repack(ck, fmt, None, progress=True)
    runs = []
    for r in range(args.rounds):
        for d in (args.depths if r % 2 == 0 else args.depths[::-1]):
            runs.append({"round": r, **one_run(rp, fmt, mc, d)})
            print(runs[-1], flush=True)
    summary = {f"depth{d}": {k: statistics.median(x[k] for x in runs if x["io_depth"] == d)
                             for k in ("wall_s", "io_read_s", "MB_s", "max_inflight")} for d in args.depths}
    base = summary[f"depth{args.depths[0]}"]["MB_s"]
    for d in args.depths[1:]:
        summary[f"depth{d}"][f"MB_s_vs_depth{args.depths[0]}"] = summary[f"depth{d}"]["MB_s"] / base
    name = args.model if args.model in ("demo", "widened") else Path(args.model).name
    res = {"benchmark": "io_overlap", "command": " ".join(["python"] + sys.argv), "model": str(path),
           "bytes_per_expert": fmt.stored_bytes, "reads_per_run": runs[0]["reads"], "rounds": args.rounds,
           "depths": args.depths, "runs": runs, "summary": summary, "machine": machine_info(path)}
    write_results(res, args.out or REPO / "benchmarks" / "results" / f"io_overlap_{name}.json", draw)


if __name__ == "__main__":
    main()
