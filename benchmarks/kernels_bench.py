"""The native CPU kernels (`specmoe.kernels`) against torch's `F.linear` and this machine's read bandwidth: one
projection y = x·Wᵀ of 1-16 fp32 rows over W in its stored format, at expert shapes of the widened copies, with 1
and 2 threads; and the per-read checksum's speed.

    .venv/bin/python benchmarks/kernels_bench.py [--rows 1,2,4,8,16 --threads 1,2 --rounds 5]

Per shape, thread count, row count and kernel: milliseconds per product, the median of --rounds rounds in which
every kernel runs once, interleaved (each a pass over enough distinct weights that none stays in a CPU cache).
Kernels: native bf16 / int8 / int4-g32 weights, `F.linear` on the fp32 upcast copy (what specmoe computed before)
and on bf16 weights. Bandwidth: a 2 GiB fp32 sum with the same threads. Writes benchmarks/results/kernels.json
(+ png) with the issue's targets evaluated.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from specmoe import kernels  # noqa: E402
from specmoe.bench.machine import machine_info, provenance  # noqa: E402
from specmoe.bench.plots import write_results  # noqa: E402
from specmoe.experts import integrity  # noqa: E402

SHAPES = {"3072x1024": (3072, 1024), "6144x2048": (6144, 2048), "12288x4096": (12288, 4096)}  # (out, in)
PASS_BYTES = 256 << 20  # fp32 bytes of weights per pass: far past any cache
KERNELS = ("native bf16", "native int8", "native int4", "F.linear fp32", "F.linear bf16")


def make(o: int, i: int, n: int) -> dict:
    """n distinct weights of each kernel's kind: (fn, [args per weight])."""
    g = torch.Generator().manual_seed(o + i)
    w32 = [torch.randn(o, i, generator=g) * 0.05 for _ in range(n)]
    out = {"F.linear fp32": (lambda x, w: F.linear(x, w), w32)}
    bf = [w.bfloat16() for w in w32]
    out["native bf16"] = (lambda x, w: kernels.linear(x, w), bf)
    out["F.linear bf16"] = (lambda x, w: F.linear(x.bfloat16(), w), bf)
    i8 = []
    for w in w32:
        s = w.abs().amax(1) / 127
        i8.append((torch.round(w / s[:, None]).to(torch.int8), s))
    out["native int8"] = (lambda x, ws: kernels.linear(x, ws[0], None, ws[1]), i8)
    i4 = [(torch.randint(0, 256, (o, i // 2), dtype=torch.uint8, generator=g),
           (torch.rand(o, i // 32, generator=g) * 0.01).half()) for _ in range(n)]
    out["native int4"] = (lambda x, ws: kernels.linear(x, ws[0], None, ws[1], 32), i4)
    return out


def per_product(fn, ws, x) -> float:
    t = time.perf_counter()
    for w in ws:
        fn(x, w)
    return (time.perf_counter() - t) / len(ws)


def bandwidth(rounds: int) -> float:
    """GB/s of a 2 GiB fp32 sum (torch, this process's threads): best of `rounds`."""
    a = torch.ones(1 << 29)
    a.sum()
    best = min(per_product(lambda x, w: x.sum(), [None], a) for _ in range(rounds))
    return a.numel() * 4 / best / 1e9


def checksum_speed(rounds: int) -> float:
    """GB/s of the per-read checksum on one core over a 144 MiB buffer: best of `rounds`."""
    buf = np.random.default_rng(0).integers(0, 256, 144 << 20, dtype=np.uint8)
    integrity.checksum(buf)
    best = min(per_product(lambda x, w: integrity.checksum(x), [None], buf) for _ in range(rounds))
    return buf.nbytes / best / 1e9


def targets(table: list[dict], bw: dict) -> dict:
    """The issue's targets, each {"value", "target", "met"}: bf16 one row ≥ 0.8× read bandwidth (weights ≥ 4 MiB, 2
    threads); bf16 4 rows ≤ 1.2× and 16 rows ≤ 2.6× one row; int8 one row ≤ 0.55× and int4 ≤ 0.45× bf16's time."""
    def ms(shape, th, rows, k):
        return next(r[f"{k} ms"] for r in table if r["shape"] == shape and r["threads"] == th and r["rows"] == rows)
    out = {}
    for shape, (o, i) in SHAPES.items():
        th = 2 if 2 in bw else max(bw)
        one = ms(shape, th, 1, "native bf16")
        if o * i * 2 >= 4 << 20:
            gbs = o * i * 2 / one / 1e6
            out[f"{shape} bf16 1 row GB/s / read bandwidth ({th} threads)"] = {
                "value": gbs / bw[th], "target": ">= 0.8", "met": gbs / bw[th] >= 0.8}
        for rows, lim in ((4, 1.2), (16, 2.6)):
            if any(r["rows"] == rows for r in table):
                v = ms(shape, th, rows, "native bf16") / one
                out[f"{shape} bf16 {rows} rows / 1 row ({th} threads)"] = {"value": v, "target": f"<= {lim}",
                                                                           "met": v <= lim}
        for k, lim in (("native int8", 0.55), ("native int4", 0.45)):
            v = ms(shape, th, 1, k) / one
            out[f"{shape} {k.split()[1]} 1 row / bf16 ({th} threads)"] = {"value": v, "target": f"<= {lim}",
                                                                          "met": v <= lim}
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="1,2,4,8,16")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "kernels.json"))
    args = ap.parse_args()
    if not kernels.available():
        print(f"the native kernels are not available here: {kernels.state()['reason']}")
        return 1
    rows = [int(r) for r in args.rows.split(",")]
    threads = [int(t) for t in args.threads.split(",")]
    table, bw = [], {}
    for th in threads:
        torch.set_num_threads(th)
        bw[th] = bandwidth(args.rounds)
        print(f"{th} thread(s): read bandwidth {bw[th]:.1f} GB/s (2 GiB fp32 sum)", flush=True)
        for shape, (o, i) in SHAPES.items():
            n = max(2, min(32, PASS_BYTES // (o * i * 4)))
            ks = make(o, i, n)
            for r in rows:
                x = torch.randn(r, i)
                t = {k: [] for k in KERNELS}
                for k in KERNELS:  # warm up
                    per_product(ks[k][0], ks[k][1][:1], x)
                for _ in range(args.rounds):
                    for k in KERNELS:
                        t[k].append(per_product(ks[k][0], ks[k][1], x))
                row = {"shape": shape, "out": o, "in": i, "threads": th, "rows": r,
                       **{f"{k} ms": statistics.median(v) * 1e3 for k, v in t.items()}}
                row["native bf16 GB/s"] = o * i * 2 / row["native bf16 ms"] / 1e6
                table.append(row)
                print(f"{shape:11s} {th}t rows {r:2d}: " + ", ".join(f"{k} {row[k + ' ms']:.3f}" for k in KERNELS)
                      + f" ms; bf16 {row['native bf16 GB/s']:.1f} GB/s", flush=True)
            del ks
    torch.set_num_threads(1)
    ck = checksum_speed(args.rounds)
    print(f"checksum ({integrity.NAME}) on one core: {ck:.1f} GB/s")
    res = {"command": "python " + " ".join(sys.argv), "commit": provenance()["git_commit"],
           "provenance": provenance(), "machine": machine_info(), "kernel_path": kernels.path(),
           "rounds": args.rounds, "read_bandwidth_gbs": {str(k): v for k, v in bw.items()}, "table": table,
           "checksum": {"name": integrity.NAME, "gbs_one_core": ck, "target": ">= 10", "met": ck >= 10},
           "targets": targets(table, bw)}
    for k, v in res["targets"].items():
        print(f"{'met  ' if v['met'] else 'UNMET'} {k}: {v['value']:.2f} (target {v['target']})")
    write_results(res, args.out, plot)
    return 0


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    ths = sorted({r["threads"] for r in res["table"]})
    fig, axes = plt.subplots(len(ths), len(SHAPES), figsize=(5 * len(SHAPES), 3.6 * len(ths)), squeeze=False)
    for a, th in enumerate(ths):
        for b, shape in enumerate(SHAPES):
            ax = axes[a][b]
            pts = [r for r in res["table"] if r["threads"] == th and r["shape"] == shape]
            for k in KERNELS:
                ax.plot([p["rows"] for p in pts], [p[f"{k} ms"] for p in pts], "o-", label=k, ms=3)
            o, i = SHAPES[shape]
            floor = o * i * 2 / (res["read_bandwidth_gbs"][str(th)] * 1e6)
            ax.axhline(floor, color="grey", ls=":", label="bf16 bytes at read bandwidth")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{shape}, {th} thread(s)", fontsize=9)
            ax.set_xlabel("rows")
            ax.set_ylabel("ms per product")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle(f"native kernels ({res['kernel_path']}) vs F.linear — {res['machine'].get('cpu_model')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
