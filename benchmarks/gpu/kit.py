"""The GPU run kit: one short run that measures SpecMoE's regime (experts in pinned host RAM behind the
real host-device link) on a lent accelerator, and exits non-zero if an exactness check fails.

    benchmarks/gpu/run.sh OUT_DIR                       # CUDA, ≤ 8 min on one H100/H200-class GPU
    benchmarks/gpu/run.sh OUT_DIR --device cpu --tiny   # the CPU dry run the test suite runs

Steps (each writes into OUT_DIR as it finishes, so a lease that ends early still leaves results):
1. machine.json: GPU, driver, torch/CUDA, PCIe link if readable, host→device bandwidth measured with pinned
   memory (on CPU: a host memcpy, labelled so);
2. tests.json: the CUDA-marked tests (offloaded == resident, SpecMoE == AR greedy on the device);
3. exactness.json: on the demo model, fp32 greedy tokens of offloaded LRU and of SpecMoE vs all-resident
   plain decoding (must be equal), and the bf16 match rate of SpecMoE vs plain decoding (reported);
4. a function-preserving widened copy of the demo model whose experts weigh ~24 MiB each (several GB
   in all), then `specmoe bench` rows for resident / ondemand / lru / overlap / specmoe / auto at batch
   1, 16, 64, 256 on the host tier (real link, not emulated), plus γ and N sweeps at the batch where
   SpecMoE gained most: results.json, PNG plots and README.md (the bench report);
5. summary.md: the machine, the checks and the headline rows in one page.

Needs only what a CUDA machine image has (torch, transformers, safetensors, tokenizers, numpy, tqdm,
matplotlib); no pip, no downloads; run from the repository root with PYTHONPATH=. (run.sh does).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]


def _dump(out: Path, name: str, obj) -> None:
    from specmoe.bench.measure import jsonable
    (out / name).write_text(json.dumps(jsonable(obj), indent=1))


def _smi(query: str) -> str | None:
    try:
        r = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=20)
        return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None


def h2d_bandwidth(device: torch.device, nbytes: int, repeats: int = 5) -> dict:
    """Best of `repeats` copies of `nbytes` from pinned host memory to the device (GB/s = 1e9 B/s)."""
    if device.type == "cuda":
        src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(device)
        best = float("inf")
        for _ in range(repeats):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src, non_blocking=True)
            b.record()
            torch.cuda.synchronize(device)
            best = min(best, a.elapsed_time(b) / 1e3)
        return {"what": "pinned host -> device copy", "bytes": nbytes, "gbps": nbytes / best / 1e9}
    src, dst = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return {"what": "host memcpy (CPU run: no device link)", "bytes": nbytes, "gbps": nbytes / best / 1e9}


def machine(device: torch.device, tiny: bool) -> dict:
    from specmoe.bench.machine import machine_info
    m = {"device": str(device), "torch": torch.__version__, "cuda": torch.version.cuda, "host": machine_info()}
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        m.update(gpu=p.name, gpu_memory_gib=round(p.total_memory / 2**30, 1), capability=f"{p.major}.{p.minor}",
                 driver=_smi("driver_version"), pcie_gen=_smi("pcie.link.gen.current"),
                 pcie_width=_smi("pcie.link.width.current"), pcie_gen_max=_smi("pcie.link.gen.max"))
    m["h2d"] = h2d_bandwidth(device, (16 if tiny else 1024) * 2**20)
    return m


def cuda_tests(out: Path) -> dict:
    """The CUDA-marked tests (they skip cleanly without a GPU)."""
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", "tests"],
                       cwd=REPO, capture_output=True, text=True)
    res = {"returncode": r.returncode, "seconds": time.perf_counter() - t0,
           "summary": (r.stdout.strip().splitlines() or [""])[-1], "ok": r.returncode == 0}
    (out / "tests.log").write_text(r.stdout + r.stderr)
    return res


def exactness(device: torch.device, prompts: list[list[int]], *, tokens: int) -> dict:
    """Greedy tokens on the demo model: offloaded LRU and SpecMoE in fp32 must equal all-resident plain decoding;
    SpecMoE's bf16 match rate is reported (bf16 output may differ after a near tie)."""
    from specmoe import LLM, SamplingParams
    sp = SamplingParams(max_tokens=tokens, ignore_eos=True)
    offload = dict(offload="host", cache_experts=12, cache_policy="lru")
    res = {"batch": len(prompts), "tokens": tokens}
    ref = [o.token_ids for o in LLM(dtype="float32", device=str(device)).generate(prompts, sp)]
    for name, kw in (("lru_fp32", offload), ("specmoe_fp32", {**offload, "decoding": "specmoe"})):
        got = [o.token_ids for o in LLM(dtype="float32", device=str(device), **kw).generate(prompts, sp)]
        res[name] = {"identical_sequences": sum(a == b for a, b in zip(ref, got)), "sequences": len(ref)}
    ref16 = [o.token_ids for o in LLM(dtype="bfloat16", device=str(device)).generate(prompts, sp)]
    got16 = [o.token_ids for o in LLM(dtype="bfloat16", device=str(device), decoding="specmoe", **offload)
             .generate(prompts, sp)]
    res["specmoe_bf16_match_rate"] = sum(a == b for a, b in zip(ref16, got16)) / len(ref16)
    res["ok"] = all(res[k]["identical_sequences"] == res[k]["sequences"] for k in ("lru_fp32", "specmoe_fp32"))
    return res


def bench_config(out: Path, device: torch.device, model: Path, tiny: bool, budget_s: float, cache: Path):
    from specmoe.bench.config import BenchConfig
    systems = ("resident", "ondemand", "lru", "overlap", "specmoe", "auto")
    common = dict(model=str(model), out=str(out), preset="gpu-kit-tiny" if tiny else "gpu-kit", device=str(device),
                  tiers=("host",), systems=systems, link_gbps=None, link_latency_us=None, sweep_batch="best",
                  sweep_tier="host", policies=False, substitutions=False, peers=(), widened=False,
                  time_budget_s=budget_s, peer_reserve_s=0.0, repeats=1, cache_dir=str(cache))
    if tiny:
        return BenchConfig(**common, dtype="float32", batch_sizes=(1, 2), max_tokens=3, prompt_tokens=12,
                           gammas=(2,), draft_experts=(2,), threads=1, progress=False)
    # on CUDA, host-side timers around asynchronous kernels would mislabel the breakdown: not instrumented
    return BenchConfig(**common, dtype="bfloat16", batch_sizes=(1, 16, 64, 256), max_tokens=16, prompt_tokens=32,
                       gammas=(2, 4, 6, 8), draft_experts=(2, 4, 8, 16), threads=None,
                       instrument=device.type != "cuda")


def summary(out: Path, m: dict, tests: dict, exact: dict, res: dict | None, elapsed: float) -> str:
    h = m["h2d"]
    lines = ["# specmoe GPU run kit", "",
             f"- device: {m.get('gpu', m['device'])}; torch {m['torch']}, CUDA {m['cuda']}, driver {m.get('driver')}, "
             f"PCIe gen {m.get('pcie_gen')} x{m.get('pcie_width')}",
             f"- {h['what']}: {h['gbps']:.1f} GB/s ({h['bytes'] / 2**20:.0f} MiB, best of 5)",
             f"- CUDA-marked tests: {tests['summary']} (exit {tests['returncode']})",
             f"- exactness (demo model, batch {exact['batch']}, {exact['tokens']} tokens): offloaded LRU fp32 "
             f"{exact['lru_fp32']['identical_sequences']}/{exact['lru_fp32']['sequences']}, SpecMoE fp32 "
             f"{exact['specmoe_fp32']['identical_sequences']}/{exact['specmoe_fp32']['sequences']} identical to "
             f"all-resident plain greedy; SpecMoE bf16 match rate {exact['specmoe_bf16_match_rate']:.2f}",
             f"- total {elapsed:.0f} s", ""]
    if res is not None:
        link = "pinned host RAM over the real host-device link" if m["device"].startswith("cuda") else \
            "host RAM copied into CPU slots (a CPU run: no device link, nothing emulated)"
        lines += [f"## Tokens/s by system and batch (host tier: {link})", "",
                  "| system | " + " | ".join(f"b={b}" for b in res["config"]["batch_sizes"]) + " |",
                  "|---|" + "---|" * len(res["config"]["batch_sizes"])]
        by = {}
        for r in res["runs"]:
            if r.get("status") == "ok":
                by.setdefault(r["system"], {})[r["batch"]] = r
        for name, rows in by.items():
            cells = [f"{rows[b]['tokens_per_s']:.1f}" if b in rows else "—" for b in res["config"]["batch_sizes"]]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines += ["", "SpecMoE speedup over each baseline:", "",
                  "| batch | vs | speedup | bytes/token (SpecMoE / baseline) |", "|---|---|---|---|"]
        for r in res.get("headline", []):
            bpt = (f"{r['bytes_per_token'] / 2**20:.1f} / {r['vs_bytes_per_token'] / 2**20:.1f} MiB"
                   if r.get("bytes_per_token") is not None and r.get("vs_bytes_per_token") is not None else "—")
            lines.append(f"| {r['batch']} | {r['vs']} | {r['speedup']:.2f}× | {bpt} |")
        lines += ["", "Full report: [README.md](README.md); raw rows: results.json.", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="output directory")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (dry run)")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes: the CPU dry run of the test suite")
    ap.add_argument("--budget-s", type=float, default=None, help="time budget of the bench step (default 330 s)")
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "specmoe"),
                    help="where the widened model is built (several GB: keep it out of OUT)")
    a = ap.parse_args(argv)
    t0 = time.monotonic()
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but CUDA is not available (use --device cpu --tiny for the dry run)",
              file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from specmoe.bench.runner import load_prompts, minfo_vocab, run_bench
    from specmoe.bench.config import BenchConfig
    from specmoe.bench.widen import widened_copy
    from specmoe.engine.llm import default_model_path
    from specmoe.engine.tokenizer import Tokenizer

    print("[1/5] machine", flush=True)
    m = machine(device, a.tiny)
    _dump(out, "machine.json", m)
    print(f"      {m.get('gpu', m['device'])}: {m['h2d']['what']} {m['h2d']['gbps']:.1f} GB/s", flush=True)
    print("[2/5] CUDA-marked tests", flush=True)
    tests = cuda_tests(out)
    _dump(out, "tests.json", tests)
    print(f"      {tests['summary']}", flush=True)
    demo = default_model_path()
    prompts, _ = load_prompts(BenchConfig(prompt_tokens=32), Tokenizer.load(demo), minfo_vocab(demo), 16)
    print("[3/5] exactness on the demo model", flush=True)
    exact = exactness(device, prompts[:2] if a.tiny else prompts, tokens=6 if a.tiny else 24)
    _dump(out, "exactness.json", exact)
    print(f"      fp32 exact: {exact['ok']}; bf16 SpecMoE match rate {exact['specmoe_bf16_match_rate']:.2f}",
          flush=True)
    print("[4/5] widened model + bench", flush=True)
    cache = Path(a.cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    wpath, winfo = widened_copy(demo, cache_dir=cache, hidden=1024 if a.tiny else 4096,
                                expert_mb=0.25 if a.tiny else 24.0, check_prompts=prompts[:2 if a.tiny else 4],
                                progress=not a.tiny,
                                device=str(device))
    budget = a.budget_s if a.budget_s is not None else (120.0 if a.tiny else 330.0)
    cfg = bench_config(out, device, wpath, a.tiny, budget, cache)
    res = run_bench(cfg, command="benchmarks/gpu/run.sh " + " ".join(argv if argv is not None else sys.argv[1:]))
    print("[5/5] summary", flush=True)
    text = summary(out, m, tests, exact, res, time.monotonic() - t0)
    (out / "summary.md").write_text(text)
    print(text)
    ok = tests["ok"] and exact["ok"]
    if not ok:
        print("error: an exactness check failed (see tests.json / exactness.json)", file=sys.stderr)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
