"""Why `auto`'s plain steps run slower than the LRU engine's on CUDA: a diagnosis kit for a lent GPU.

    python3 benchmarks/gpu/auto_plain.py OUT_DIR                         # CUDA, widened demo model, ~3 min
    python3 benchmarks/gpu/auto_plain.py OUT_DIR --device cpu --tiny     # CPU dry run (demo model, 4 tokens)
    python3 benchmarks/gpu/auto_plain.py OUT_DIR --device cpu --demo     # the same question on CPU, demo model

The GPU kit (`benchmarks/gpu/run.sh`) measured `auto` at batch 64 and 256 taking plain steps only (the same expert
bytes per token as LRU) at about half the LRU engine's tokens/s. This runs, at one batch, interleaved rounds of:
- `ar-lru`: plain decoding, LRU cache (the kit's fastest system);
- `ar-adaptive`: plain decoding on the host tier's default policy (`auto`'s);
- `auto-plain`: `auto` forced to plain steps (its controller's `force`), default policy;
- `auto-plain-lru`: the same on LRU;
- `auto`: `auto` as the kit runs it;
then `auto-plain-noobs`: forced plain with the controller's routing observer removed from the model runner.
Each row: decode tokens/s per round, expert compute and fetch-wait seconds, the controller's own seconds. With
`--profile`, torch.profiler tables (self CPU time; CUDA sync and copy calls counted) of one run of `ar-lru` and
`auto-plain` go to OUT_DIR/profile_*.txt. Results: OUT_DIR/auto_plain.json.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from specmoe import LLM, SamplingParams  # noqa: E402
from specmoe.bench.machine import machine_info  # noqa: E402
from specmoe.engine.auto import controller_of  # noqa: E402
from specmoe.engine.llm import default_model_path  # noqa: E402

SYSTEMS = {"ar-lru": {"decoding": "ar", "cache_policy": "lru"},
           "ar-adaptive": {"decoding": "ar"},
           "auto-plain": {"decoding": "auto"},
           "auto-plain-lru": {"decoding": "auto", "cache_policy": "lru"},
           "auto": {"decoding": "auto"}}
STAT = ("decode_time_s", "decode_steps", "expert_compute_s", "fetch_wait_s", "controller_s", "ar_time_s", "hits",
        "misses", "scheduling_s", "plain_step_share")


def run(llm, prompts, max_tokens: int) -> dict:
    llm.reset_stats()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    wall = time.perf_counter() - t0
    st = llm.stats
    dec = st["generated_tokens"] - len(prompts)
    return {"wall_s": wall, "decode_tok_s": dec / st["decode_time_s"], **{k: st[k] for k in STAT if k in st}}


def profile(llm, prompts, max_tokens: int, path: Path) -> dict:
    from torch.profiler import ProfilerActivity, profile as prof
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with prof(activities=acts) as p:
        run(llm, prompts, max_tokens)
    ka = p.key_averages()
    path.write_text(ka.table(sort_by="self_cpu_time_total", row_limit=40))
    keys = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "cudaEventSynchronize",
            "aten::item", "aten::_local_scalar_dense", "aten::to", "aten::copy_", "cudaLaunchKernel")
    return {e.key: {"count": e.count, "self_cpu_s": e.self_cpu_time_total / 1e6} for e in ka if e.key in keys}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--demo", action="store_true", help="the demo model itself (not widened): a CPU-sized run")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "specmoe"))
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    path = default_model_path()
    if not (a.tiny or a.demo):
        from specmoe.bench.widen import widened_copy
        path = widened_copy(path, cache_dir=a.cache_dir, hidden=4096, expert_mb=24.0, device=a.device,
                            check_prompts=None, progress=False)[0]
    max_tokens = 4 if a.tiny else a.max_tokens
    dtype = "float32" if a.tiny else "bfloat16"
    tier = {"offload": "host", "cache_experts": 8, "prefetch": "none"}
    llms = {n: LLM(str(path), dtype=dtype, device=a.device, **tier, **o) for n, o in SYSTEMS.items()}
    for n in ("auto-plain", "auto-plain-lru"):
        controller_of(llms[n]).force = "plain"
    tok = llms["ar-lru"].tokenizer
    text = (REPO / "benchmarks" / "prompts" / "code.jsonl").read_text().splitlines()
    prompts = [tok.encode(json.loads(x)["prompt"])[:32] for x in text]
    B = 2 if a.tiny else a.batch
    batch = [prompts[i % len(prompts)] for i in range(B)]
    for llm in llms.values():  # first kernels, calibration, the cache's first fill
        run(llm, batch, max_tokens)
    rows = {n: [] for n in SYSTEMS}
    for r in range(a.rounds):
        names = list(SYSTEMS)
        names = names[r % len(names):] + names[:r % len(names)]
        for n in names:
            rows[n].append(run(llms[n], batch, max_tokens))
            print(f"round {r} {n:15s} {rows[n][-1]['decode_tok_s']:9.1f} tok/s", flush=True)
    profiles = {}
    if a.profile:
        for n in ("ar-lru", "auto-plain"):
            profiles[n] = profile(llms[n], batch, max_tokens, out / f"profile_{n}.txt")
    # the controller's routing observer removed from the runner (built last: the patch is process-wide)
    from specmoe.decoding.control.controller import Controller
    Controller.observer = property(lambda self: (lambda layer, routing: None))
    noobs = LLM(str(path), dtype=dtype, device=a.device, **tier, decoding="auto")
    controller_of(noobs).force = "plain"
    run(noobs, batch, max_tokens)
    rows["auto-plain-noobs"] = [run(noobs, batch, max_tokens) for _ in range(a.rounds)]
    rows["ar-lru-after"] = [run(llms["ar-lru"], batch, max_tokens) for _ in range(a.rounds)]
    summary = {n: {"median_decode_tok_s": statistics.median(x["decode_tok_s"] for x in v),
                   **{k: statistics.median(float(x.get(k, 0.0)) for x in v) for k in STAT}} for n, v in rows.items()}
    res = {"command": " ".join(sys.argv), "machine": machine_info(), "model": str(path), "batch": B,
           "max_tokens": max_tokens, "dtype": dtype, "tier": tier, "summary": summary, "rows": rows,
           "profiles": profiles}
    (out / "auto_plain.json").write_text(json.dumps(res, indent=1, default=str))
    for n, s in summary.items():
        print(f"{n:17s} {s['median_decode_tok_s']:9.1f} tok/s  expert {s['expert_compute_s']:.3f} s  "
              f"wait {s['fetch_wait_s']:.3f} s  controller {s['controller_s']:.3f} s  steps {s['decode_steps']:.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
