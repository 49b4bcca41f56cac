"""What `deterministic=True` costs in fp32: decode tokens/s of the demo model in fp32 with and without it, in one
process, on the kernel path this machine takes (the native kernels compute a deterministic model's products unpadded;
the torch path pads every product to the measured row class).

    .venv/bin/python benchmarks/deterministic_cost.py [--batches 1,16 --tokens 48 --rounds 5 --threads 2]

Decode tokens/s = batch × (n − 1) / (wall of an n-token generate − wall of a 1-token one), greedy, EOS ignored, the
same prompts for both; each round runs both models once, the order alternated between rounds; per batch the median
of the per-round ratios deterministic ÷ plain. Both models' tokens are compared too (equal is expected but not
required: plain fp32 may round a row differently in a batch). Writes benchmarks/results/deterministic_cost.json.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from specmoe import LLM, SamplingParams, kernels  # noqa: E402
from specmoe.bench.machine import machine_info, provenance  # noqa: E402
from specmoe.bench.measure import decode_rate  # noqa: E402
from specmoe.bench.plots import write_results  # noqa: E402

TARGET = 0.95  # deterministic ÷ plain decode tokens/s: costs at most 5%


def greedy(llm: LLM):
    """`decode_rate`'s generate: greedy, EOS ignored, the token ids returned."""
    return lambda prompts, k: [o.token_ids for o in llm.generate(
        prompts, SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "deterministic_cost.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    models = {"fp32": LLM(dtype="float32", threads=args.threads),
              "fp32 deterministic": LLM(dtype="float32", threads=args.threads, deterministic=True)}
    texts = ["def fibonacci(n):", "And God said,", "The json module", "In the beginning"]
    tok = models["fp32"].tokenizer
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        prompts = [tok.encode(texts[i % len(texts)]) for i in range(b)]
        for m in models.values():  # warm-up
            decode_rate(greedy(m), prompts, 4)
        rates = {k: [] for k in models}
        same = True
        for r in range(args.rounds):
            order = list(models) if r % 2 == 0 else list(models)[::-1]
            toks = {}
            for k in order:
                rate, toks[k] = decode_rate(greedy(models[k]), prompts, args.tokens)
                rates[k].append(rate)
            same &= toks["fp32"] == toks["fp32 deterministic"]
        ratios = [d / p for d, p in zip(rates["fp32 deterministic"], rates["fp32"])]
        row = {"batch": b, "tok_s": rates, "median_tok_s": {k: statistics.median(v) for k, v in rates.items()},
               "ratio_per_round": ratios, "ratio": statistics.median(ratios), "same_tokens": same}
        rows.append(row)
        print(f"batch {b}: fp32 {row['median_tok_s']['fp32']:.1f}, deterministic "
              f"{row['median_tok_s']['fp32 deterministic']:.1f} tok/s; deterministic / plain {row['ratio']:.3f} "
              f"(target >= {TARGET}); same tokens: {same}", flush=True)
    res = {"command": "python " + " ".join(sys.argv), "commit": provenance()["git_commit"],
           "provenance": provenance(), "machine": machine_info(), "kernel_path": kernels.path(),
           "threads": args.threads, "rounds": args.rounds, "tokens": args.tokens, "rows": rows,
           "targets": {f"batch {r['batch']}": {"value": r["ratio"], "target": f">= {TARGET}",
                                               "met": r["ratio"] >= TARGET} for r in rows}}
    write_results(res, args.out, plot)
    return 0


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    rows = res["rows"]
    fig, ax = plt.subplots(figsize=(4.2, 3.2))
    w = 0.38
    for i, k in enumerate(("fp32", "fp32 deterministic")):
        ax.bar([j + i * w for j in range(len(rows))], [r["median_tok_s"][k] for r in rows], w, label=k)
    ax.set_xticks([j + w / 2 for j in range(len(rows))], [f"batch {r['batch']}" for r in rows])
    ax.set_ylabel("decode tokens/s (median)")
    ax.set_title(f"demo model, {res['kernel_path']}, {res['threads']} threads", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
