"""What k rows of a projection cost against one row, computed as `F.linear(x, W)` or weight-major, (W @ xᵀ)ᵀ
(`specmoe.models.orientation`), at the weight shapes of the demo model and its widened copies, fp32 and bf16; and
the threshold the engine's own probe picks on this machine.

    .venv/bin/python benchmarks/orientation_bench.py [--rows 1,2,4,8,16,64 --rounds 5 --threads 2]

Per shape, dtype and row count: milliseconds per product (median of --rounds interleaved rounds, each a pass over
enough distinct weights that none stays in a CPU cache between products). Writes
benchmarks/results/orientation.json and a plot next to it."""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from specmoe.bench.machine import machine_info, provenance  # noqa: E402
from specmoe.bench.plots import write_results  # noqa: E402
from specmoe.models import orientation  # noqa: E402

SHAPES = {  # name -> (out, in)
    "demo lm_head": (8192, 256),
    "demo expert gate_up": (192, 256),
    "widened (1024) expert gate_up": (3072, 1024),
    "widened (4096) attention qkv": (6144, 4096),
    "widened (4096) expert gate_up": (12288, 4096),
    "widened (4096) expert down": (4096, 6144),
}
PASS_BYTES = 64 << 20  # at least this many weight bytes per pass


def per_product(fn, mats, x) -> float:
    t = time.perf_counter()
    for w in mats:
        fn(x, w)
    return (time.perf_counter() - t) / len(mats)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8,16,64")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "orientation.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = [int(r) for r in args.rows.split(",")]
    fns = {"F.linear": lambda x, w: F.linear(x, w), "weight-major": lambda x, w: orientation.weight_major(x, w)}
    table = []
    for dtype in (torch.float32, torch.bfloat16):
        for name, (o, i) in SHAPES.items():
            n = max(1, min(16, PASS_BYTES // (o * i * dtype.itemsize)))
            mats = [torch.randn(o, i).to(dtype) for _ in range(n)]
            for r in rows:
                x = torch.randn(r, i).to(dtype)
                t = {k: [] for k in fns}
                for k, f in fns.items():
                    per_product(f, mats[:1], x)
                for _ in range(args.rounds):
                    for k, f in fns.items():
                        t[k].append(per_product(f, mats, x))
                row = {"shape": name, "out": o, "in": i, "dtype": str(dtype).removeprefix("torch."), "rows": r,
                       **{f"{k} ms": statistics.median(v) * 1e3 for k, v in t.items()}}
                row["weight-major / F.linear"] = row["weight-major ms"] / row["F.linear ms"]
                table.append(row)
                print(f"{row['dtype']:9s} {name:32s} rows {r:3d}: F.linear {row['F.linear ms']:8.3f} ms, "
                      f"weight-major {row['weight-major ms']:8.3f} ms ({row['weight-major / F.linear']:.2f}x)",
                      flush=True)
            del mats
    probes = {str(dt).removeprefix("torch."): orientation.probe(dt) for dt in (torch.float32, torch.bfloat16)}
    for k, v in probes.items():
        print(f"probe {k}: weight-major from {v['min_numel']} elements" if v["min_numel"] else
              f"probe {k}: F.linear everywhere")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    res = {"command": "python " + " ".join(sys.argv), "commit": provenance()["git_commit"],
           "provenance": provenance(), "machine": machine_info(), "threads": args.threads, "rounds": args.rounds,
           "table": table, "probe": probes}
    write_results(res, out, plot)
    return 0


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    dtypes = sorted({r["dtype"] for r in res["table"]})
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4), sharey=True)
    for ax, dt in zip(axes, dtypes):
        for shape in SHAPES:
            pts = [r for r in res["table"] if r["dtype"] == dt and r["shape"] == shape]
            one = pts[0]["F.linear ms"]
            ax.plot([p["rows"] for p in pts], [p["F.linear ms"] / one for p in pts], "-", label=f"{shape}: F.linear")
            ax.plot([p["rows"] for p in pts], [p["weight-major ms"] / one for p in pts], "--",
                    color=ax.lines[-1].get_color(), label=f"{shape}: weight-major")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xlabel("rows")
        ax.set_title(f"{dt}: time / one row's F.linear ({res['machine'].get('cpu_model')})")
    axes[0].set_ylabel("relative time")
    axes[-1].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
