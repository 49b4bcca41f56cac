"""How fast one expert matrix streams at batch 1: the effective weight bandwidth of a single-row matmul through
torch's CPU paths, against this machine's memory bandwidth (a tensor sum). At batch 1 an expert's FFN is three
such matrix-vector products, so this bounds what a decode step can do once its experts are in memory.

    .venv/bin/python benchmarks/expert_gemv.py [--rows 6144 --cols 4096 --mats 8 --reps 5 --threads 2]

Writes benchmarks/results/expert_gemv.json (median of --reps passes over --mats distinct matrices, so no matrix
stays in cache between products)."""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from specmoe.bench.machine import machine_info  # noqa: E402


def gbps(fn, mats: list[torch.Tensor], reps: int) -> float:
    """Median over reps of (bytes of every matrix / seconds of one pass applying fn to each)."""
    fn(mats[0])
    rates = []
    for _ in range(reps):
        t = time.perf_counter()
        for w in mats:
            fn(w)
        rates.append(sum(w.numel() * w.element_size() for w in mats) / (time.perf_counter() - t) / 1e9)
    return statistics.median(rates)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=6144, help="output features (an expert's intermediate size)")
    ap.add_argument("--cols", type=int, default=4096, help="input features (hidden size)")
    ap.add_argument("--mats", type=int, default=8)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "expert_gemv.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = {}
    reorder_s_per_gb = None
    for dtype in (torch.bfloat16, torch.float32):
        mats = [torch.randn(args.rows, args.cols, dtype=dtype) for _ in range(args.mats)]
        x = torch.randn(1, args.cols, dtype=dtype)
        name = str(dtype).removeprefix("torch.")
        rows[f"F.linear {name}"] = gbps(lambda w: F.linear(x, w), mats, args.reps)
        rows[f"x @ w.T {name}"] = gbps(lambda w: x @ w.t(), mats, args.reps)
        if dtype == torch.bfloat16 and torch.backends.mkldnn.is_available():
            rows[f"mkldnn linear {name}"] = gbps(
                lambda w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""), mats, args.reps)
            # the same op on weights reordered once into oneDNN's blocked layout for batch 1: faster per product,
            # but the reorder is a pass of its own, paid each time an expert arrives
            t = time.perf_counter()
            packed = [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in mats]
            reorder_s_per_gb = (time.perf_counter() - t) / (sum(w.numel() * w.element_size() for w in mats) / 1e9)
            rows[f"mkldnn linear {name}, prepacked"] = gbps(
                lambda w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""), packed, args.reps)
            del packed
        big = torch.cat([m.reshape(-1) for m in mats]).float()
        rows["memory (tensor sum, fp32)"] = gbps(lambda w: w.sum(), [big], args.reps)
        del mats, big
    for k, v in rows.items():
        print(f"{k:38s} {v:6.1f} GB/s")
    if reorder_s_per_gb is not None:
        print(f"prepacking (reorder) costs {reorder_s_per_gb:.2f} s per GB of weights")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"command": "python " + " ".join(sys.argv), "machine": machine_info(),
                               "shape": [args.rows, args.cols], "threads": args.threads, "gbps": rows,
                               "prepack_reorder_s_per_gb": reorder_s_per_gb}, indent=1)
                   + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
