"""Resident decode against llama.cpp on the same checkpoint: specmoe (native CPU kernels, the weights in their stored
bf16), specmoe on the torch path (the fp32 copies it computed on before the kernels; left out for a model whose fp32
copy would not fit in RAM beside the rest) and llama.cpp (llama-cpp-python, the bf16 GGUF converted from the same
checkpoint), same prompt token ids, greedy, same threads; with --int8, also specmoe with int8 experts (per output
channel) against llama.cpp's Q8_0 GGUF of the same checkpoint.

    .venv/bin/python benchmarks/vs_llamacpp.py [--models demo,widened1024,widened4096] [--int8 widened4096]
        [--tokens 64 --rounds 3 --threads 2]

Models: `demo` (the bundled model), `widened<H>`: its function-preserving widened copy at hidden H with experts of
EXPERT_MB[H] MB (widened4096: ~9 GiB in bf16, fits in RAM). Decode tokens/s = (n − 1) / (wall of an n-token
generate − wall of a 1-token one), so prefill is out of it, measured alike for every system. Each round runs every
system once, in turn (order alternated between rounds), each system in this one process; the figures are medians
over rounds. Also specmoe's batch-16 decode tokens/s ÷ its batch-1. Writes benchmarks/results/vs_llamacpp.json
(+ png), its `ratios` keyed "<model> <bf16|int8> B1" (specmoe ÷ llama.cpp). Needs the [bench] extra
(llama-cpp-python, gguf) and llama.cpp's converter (`pip download --no-binary :all: --no-deps llama-cpp-python -d
<cache dir>`).
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
from specmoe.bench.peers import _LlamaCpp, convert_gguf  # noqa: E402
from specmoe.bench.plots import write_results  # noqa: E402
from specmoe.bench.widen import widened_copy  # noqa: E402
from specmoe.bundled import demo_model_dir  # noqa: E402

SYSTEMS = ("specmoe", "specmoe torch path", "llama.cpp")
# specmoe ÷ llama.cpp at batch 1 (int8: specmoe's int8 experts against llama.cpp's Q8_0)
TARGETS = {"demo bf16": 0.5, "widened1024 bf16": 1.0, "widened4096 bf16": 1.0, "widened4096 int8": 1.0}
EXPERT_MB = {1024: 6.0, 4096: 48.0}  # widened copies' expert size by hidden size (4096: ~9 GiB in all, bf16)
TORCH_PATH_MAX_BYTES = 4 << 30  # the torch path's fp32 copy of a larger model would not fit beside the rest here
GGUF_TYPE = {"bf16": "bf16", "int8": "q8_0"}


def model_path(name: str, cache: Path) -> Path:
    if name == "demo":
        return demo_model_dir()
    hidden = int(name.removeprefix("widened"))
    path, _ = widened_copy(demo_model_dir(), cache_dir=cache, hidden=hidden, expert_mb=EXPERT_MB.get(hidden, 6.0),
                           check_dtypes=("bfloat16",))
    return path


def prompt_ids(llm: LLM, batch: int) -> list[list[int]]:
    texts = ["The json module", "And God said,", "def fibonacci(n):", "In the beginning"]
    return [llm.tokenizer.encode(texts[i % len(texts)]) for i in range(batch)]


def specmoe_gen(llm: LLM, native_on: bool):
    def gen(prompts, k):
        kernels.set_enabled(native_on)
        llm.generate(prompts, SamplingParams(max_tokens=k, temperature=0.0, ignore_eos=True))
    return gen


def run_model(name: str, fmt: str, args, cache: Path) -> dict:
    """One model in one format (bf16, or int8 against Q8_0): decode tokens/s of each system, interleaved rounds."""
    import gc
    path = model_path(name, cache)
    gguf, ginfo = convert_gguf(path, cache, args.llama_cpp_src, outtype=GGUF_TYPE[fmt])
    opts = {} if fmt == "bf16" else {"expert_format": "int8", "repack_dir": str(cache / "repack")}
    kernels.set_enabled(True)
    fast = LLM(str(path), dtype="float32", max_batch=16, threads=args.threads, **opts)
    gens = {"specmoe": specmoe_gen(fast, True)}
    size = sum(f.stat().st_size for f in Path(path).glob("*.safetensors"))
    torch_why = None if fmt == "bf16" and size <= TORCH_PATH_MAX_BYTES else (
        "int8 rows compare the native kernels with Q8_0" if fmt != "bf16" else
        f"the model's fp32 copy ({2 * size / 2**30:.1f} GiB) would not fit in RAM beside the rest")
    if torch_why is None:
        kernels.set_enabled(False)
        slow = LLM(str(path), dtype="float32", max_batch=1, threads=args.threads, **opts)
        kernels.set_enabled(True)
        gens["specmoe torch path"] = specmoe_gen(slow, False)
    p1 = prompt_ids(fast, 1)
    n = args.tokens
    llama = _LlamaCpp(gguf, n_ctx_seq=max(len(p) for p in p1) + n + 8, max_batch=1,
                      max_prompt_tokens=sum(len(p) for p in p1), threads=args.threads)
    gens["llama.cpp"] = lambda p, k: llama.generate(p, k)
    systems = [s for s in SYSTEMS if s in gens]
    try:
        for g in gens.values():  # warm-up
            g(p1, 4)
        rates: dict[str, list[float]] = {s: [] for s in systems}
        p16 = prompt_ids(fast, 16)
        b16: list[float] = []
        for r in range(args.rounds):
            for s in (systems if r % 2 == 0 else systems[::-1]):  # order alternated
                rates[s].append(decode_rate(gens[s], p1, n)[0])
            b16.append(decode_rate(gens["specmoe"], p16, n)[0])
            print(f"{name} {fmt} round {r + 1}: " + ", ".join(f"{s} {v[-1]:.1f}" for s, v in rates.items())
                  + f" tok/s; specmoe batch 16 {b16[-1]:.1f} tok/s", flush=True)
        same = llama.generate(p1, 16)[1][0] == fast.generate(p1, SamplingParams(
            max_tokens=16, temperature=0.0, ignore_eos=True))[0].token_ids
    finally:
        llama.close()
    med = {s: statistics.median(v) for s, v in rates.items()}
    cfg = fast.config
    out = {"model": name, "format": fmt, "llama_cpp_type": GGUF_TYPE[fmt], "path": str(path),
           "model_bytes": size, "hidden": cfg.hidden_size, "expert_intermediate": cfg.expert_intermediate_size,
           "gguf": ginfo, "tokens": n, "decode_tok_s": rates, "median_tok_s": med, "specmoe_b16_tok_s": b16,
           "specmoe_b16_over_b1": statistics.median(b16) / med["specmoe"],
           "same_first_16_tokens_as_llama_cpp": same,
           "specmoe_over_llama_cpp": med["specmoe"] / med["llama.cpp"],
           "specmoe_over_torch_path": med["specmoe"] / med["specmoe torch path"] if torch_why is None else None,
           "torch_path_skipped": torch_why}
    del fast, gens
    gc.collect()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="demo,widened1024,widened4096")
    ap.add_argument("--int8", default="widened4096", help="models also run with int8 experts against Q8_0 ('' none)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "specmoe"))
    ap.add_argument("--llama-cpp-src", default=None)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "vs_llamacpp.json"))
    args = ap.parse_args()
    if not kernels.available():
        print(f"the native kernels are not available here: {kernels.state()['reason']}")
        return 1
    torch.set_num_threads(args.threads)
    cache = Path(args.cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    todo = [(m, "bf16") for m in args.models.split(",") if m] + [(m, "int8") for m in args.int8.split(",") if m]
    runs = [run_model(m, fmt, args, cache) for m, fmt in todo]
    import llama_cpp
    ratios = {f"{r['model']} {r['format']} B1": r["specmoe_over_llama_cpp"] for r in runs}
    targets = {k: {"value": v, "target": f">= {TARGETS[k[:-3]]}", "met": v >= TARGETS[k[:-3]]}
               for k, v in ratios.items() if k[:-3] in TARGETS}
    res = {"command": "python " + " ".join(sys.argv), "commit": provenance()["git_commit"],
           "provenance": provenance(), "machine": machine_info(), "kernel_path": kernels.path(),
           "threads": args.threads, "rounds": args.rounds, "llama_cpp_python": llama_cpp.__version__,
           "runs": runs, "ratios": ratios, "targets": targets}
    for k, v in targets.items():
        print(f"{'met  ' if v['met'] else 'UNMET'} {k}: specmoe / llama.cpp {v['value']:.2f} (target {v['target']})")
    write_results(res, args.out, plot)
    return 0


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = res["runs"]
    fig, ax = plt.subplots(figsize=(1.8 + 2.2 * len(runs), 3.6))
    w = 0.8 / len(SYSTEMS)
    for i, s in enumerate(SYSTEMS):
        ax.bar([j + i * w for j in range(len(runs))], [r["median_tok_s"].get(s, 0.0) for r in runs], w, label=s)
    ax.set_xticks([j + w for j in range(len(runs))],
                  [f"{r['model']} {r['format']}\n(hidden {r['hidden']})" for r in runs], fontsize=7)
    ax.set_yscale("log")
    ax.set_ylabel("decode tokens/s, batch 1 (median)")
    ax.set_title(f"resident decode, {res['threads']} threads — {res['machine'].get('cpu_model')}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
