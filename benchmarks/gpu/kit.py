"""The GPU run kit: one short run that measures SpecMoE's regime (experts in pinned host RAM behind the
real host-device link) on a lent accelerator, and exits non-zero if any step (machine, tests, exactness, bench)
fails.

    benchmarks/gpu/run.sh OUT_DIR                       # CUDA, ≤ 8 min on one H100/H200-class GPU
    benchmarks/gpu/run.sh OUT_DIR --device cpu --tiny   # the CPU dry run the test suite runs

Steps (each writes into OUT_DIR as it finishes, so a lease that ends early still leaves results):
1. machine.json: GPU, driver, torch/CUDA, PCIe link if readable, host→device bandwidth measured with pinned
   memory (on CPU: a host memcpy, labelled so);
2. tests.json: the CUDA-marked tests (offloaded == resident, SpecMoE == AR greedy on the device), collected
   from the test modules that hold them and from no other (tests.log: pytest's output);
3. exactness.json: on the demo model, fp32 greedy tokens of offloaded LRU and of SpecMoE vs all-resident
   plain decoding (must be equal), and the bf16 match rate of SpecMoE vs plain decoding (reported);
4. a function-preserving widened copy of the demo model whose experts weigh ~24 MiB each (several GB
   in all), then `specmoe bench` rows for resident / ondemand / lru / overlap / specmoe / auto at batch
   1, 16, 64, 256 on the host tier (real link, not emulated), plus γ and N sweeps at the batch where
   SpecMoE gained most: results.json, PNG plots and README.md (the bench report);
5. summary.md (rewritten after every step) and steps.json: each step's status (ok / failed / error) and what
   it found, then the machine, the checks and the headline rows in one page.

Every step runs whatever became of the others: a step that fails or raises is recorded as such and the next
one runs. The exit status is 0 when every step passed and 1 otherwise (stderr and summary.md name the steps).

Needs only what a CUDA machine image has (torch, transformers, safetensors, tokenizers, numpy, tqdm, xxhash,
matplotlib, and pytest for step 2); no pip, no downloads, none of the serve or ray extras; run from the
repository root with PYTHONPATH=. (run.sh does). benchmarks/gpu/bare_venv.py makes such an environment here.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
import traceback
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


STEPS = ("machine", "tests", "exactness", "bench")
CUDA_MARK = re.compile(r"\bmark\.cuda\b")


def cuda_test_files() -> list[str]:
    """The test modules holding CUDA-marked tests (found by their `pytest.mark.cuda`), relative to the repository:
    the test step collects these alone, so a module needing a package this machine lacks is never imported."""
    return sorted(p.relative_to(REPO).as_posix() for p in (REPO / "tests").rglob("test_*.py")
                  if CUDA_MARK.search(p.read_text()))


def cuda_tests(out: Path, timeout_s: float = 300.0) -> dict:
    """The CUDA-marked tests (they skip cleanly without a GPU), with no pytest plugins but pytest's own: what
    this machine happens to have installed does not change the run."""
    files = cuda_test_files()
    res = {"files": files, "ok": False}
    if not files:
        return {**res, "returncode": None, "seconds": 0.0, "summary": "no CUDA-marked tests found under tests/"}
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "cuda", "-p", "no:cacheprovider", *files]
    env = {**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    try:
        r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        log = "".join(x.decode(errors="replace") if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr))
        (out / "tests.log").write_text(log)
        return {**res, "returncode": None, "seconds": time.perf_counter() - t0,
                "summary": f"timed out after {timeout_s:.0f} s"}
    (out / "tests.log").write_text(r.stdout + r.stderr)
    last = (r.stdout.strip().splitlines() or r.stderr.strip().splitlines() or [""])[-1]
    return {**res, "returncode": r.returncode, "seconds": time.perf_counter() - t0, "summary": last,
            "ok": r.returncode == 0}


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
                  time_budget_s=budget_s, peer_reserve_s=0.0, cache_dir=str(cache))
    if tiny:
        return BenchConfig(**common, dtype="float32", batch_sizes=(1, 2), max_tokens=3, prompt_tokens=12,
                           gammas=(2,), draft_experts=(2,), threads=1, progress=False, repeats=1)
    # on CUDA, host-side timers around asynchronous kernels would mislabel the breakdown: not instrumented
    # 32 tokens, 3 repeats up to batch 32 (one 16-token run at batch 1 was mostly the first kernels' start-up);
    # draft experts up to the 8 slots per layer the cache fraction gives the widened model (16 cannot be pinned)
    return BenchConfig(**common, dtype="bfloat16", batch_sizes=(1, 16, 64, 256), max_tokens=32, prompt_tokens=32,
                       gammas=(2, 4, 6, 8), draft_experts=(2, 4, 8), threads=None, repeats=3,
                       instrument=device.type != "cuda")


def bench_status(res: dict) -> tuple[bool, str]:
    """The bench step passes when it measured rows and no row raised (rows skipped for the time budget, or for an
    option this build lacks, do not fail it); the detail counts the rows by status."""
    runs = res.get("runs", [])
    count = {}
    for r in runs:
        count[r.get("status")] = count.get(r.get("status"), 0) + 1
    ok = bool(runs) and not count.get("error") and count.get("ok", 0) > 0
    detail = ", ".join(f"{n} {st}" for st, n in sorted(count.items(), key=lambda kv: str(kv[0]))) or "no rows"
    return ok, f"rows: {detail}"


def _fmt_exact(exact: dict) -> str:
    return (f"offloaded LRU fp32 {exact['lru_fp32']['identical_sequences']}/{exact['lru_fp32']['sequences']}, "
            f"SpecMoE fp32 {exact['specmoe_fp32']['identical_sequences']}/{exact['specmoe_fp32']['sequences']} "
            f"identical to all-resident plain greedy; SpecMoE bf16 match rate "
            f"{exact['specmoe_bf16_match_rate']:.2f}")


def summary(steps: dict, m: dict | None, tests: dict | None, exact: dict | None, res: dict | None,
            elapsed: float) -> str:
    """summary.md: every step's status first, then what each step that produced something found."""
    failed = [k for k in STEPS if steps.get(k, {}).get("status") not in ("ok", "pending")]
    pending = [k for k in STEPS if steps.get(k, {}).get("status", "pending") == "pending"]
    verdict = f"**FAILED: {', '.join(failed)}**" if failed else "all steps passed" if not pending else "running"
    if pending:
        verdict += f" (not run yet: {', '.join(pending)})"
    lines = ["# specmoe GPU run kit", "", f"Result: {verdict}; {elapsed:.0f} s in all.", "",
             "| step | status | detail | seconds |", "|---|---|---|---|"]
    for k in STEPS:
        st = steps.get(k, {"status": "pending", "detail": ""})
        sec = f"{st['seconds']:.0f}" if st.get("seconds") is not None else ""
        shown = st["status"] if st["status"] in ("ok", "pending") else f"**{st['status'].upper()}**"
        lines.append(f"| {k} | {shown} | {st.get('detail', '').replace('|', '/')} | {sec} |")
    lines.append("")
    if m is not None:
        h = m["h2d"]
        lines += [f"- device: {m.get('gpu', m['device'])}; torch {m['torch']}, CUDA {m['cuda']}, driver "
                  f"{m.get('driver')}, PCIe gen {m.get('pcie_gen')} x{m.get('pcie_width')}",
                  f"- {h['what']}: {h['gbps']:.1f} GB/s ({h['bytes'] / 2**20:.0f} MiB, best of 5)"]
    if tests is not None:
        lines.append(f"- CUDA-marked tests ({', '.join(tests['files']) or 'none found'}): {tests['summary']} "
                     f"(exit {tests['returncode']})")
    if exact is not None:
        lines.append(f"- exactness (demo model, batch {exact['batch']}, {exact['tokens']} tokens): "
                     f"{_fmt_exact(exact)}")
    lines.append("")
    if res is not None and m is not None:
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


class Kit:
    """Runs the steps in order; each one's outcome lands in `steps` whatever the others did."""

    def __init__(self, out: Path):
        self.out, self.t0 = out, time.monotonic()
        self.steps: dict[str, dict] = {}
        self.m = self.tests = self.exact = self.res = None

    def step(self, name: str, fn):
        """fn() -> (ok, detail, value); an exception is the step's error, printed and recorded, never raised."""
        print(f"[{STEPS.index(name) + 1}/{len(STEPS) + 1}] {name}", flush=True)
        t0 = time.perf_counter()
        try:
            ok, detail, value = fn()
            st = {"status": "ok" if ok else "failed", "detail": detail}
        except Exception as e:  # recorded, and the next step runs
            traceback.print_exc()
            value, st = None, {"status": "error", "detail": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
        st["seconds"] = time.perf_counter() - t0
        self.steps[name] = st
        print(f"      {st['status']}: {st['detail']}", flush=True)
        self.write()
        return value

    def write(self) -> str:
        text = summary(self.steps, self.m, self.tests, self.exact, self.res, time.monotonic() - self.t0)
        (self.out / "summary.md").write_text(text)
        _dump(self.out, "steps.json", self.steps)
        return text

    @property
    def failed(self) -> list[str]:
        return [k for k in STEPS if self.steps.get(k, {}).get("status") != "ok"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="output directory")
    ap.add_argument("--device", default="cuda", help="cuda (default) or cpu (dry run)")
    ap.add_argument("--tiny", action="store_true", help="tiny sizes: the CPU dry run of the test suite")
    ap.add_argument("--budget-s", type=float, default=None, help="time budget of the bench step (default 330 s)")
    ap.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "specmoe"),
                    help="where the widened model is built (several GB: keep it out of OUT)")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda but CUDA is not available (use --device cpu --tiny for the dry run)",
              file=sys.stderr)
        return 2
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    kit = Kit(out)
    kit.write()

    def prompts():  # the held-out prompts as demo-model token ids (the exactness and widening checks use them)
        from specmoe.bench.config import BenchConfig
        from specmoe.bench.runner import load_prompts, minfo_vocab
        from specmoe.engine.llm import default_model_path
        from specmoe.tokenizer import Tokenizer
        demo = default_model_path()
        return load_prompts(BenchConfig(prompt_tokens=32), Tokenizer.load(demo), minfo_vocab(demo), 16)[0]

    def machine_step():
        m = kit.m = machine(device, a.tiny)
        _dump(out, "machine.json", m)
        return True, f"{m.get('gpu', m['device'])}: {m['h2d']['what']} {m['h2d']['gbps']:.1f} GB/s", None

    def tests_step():
        kit.tests = cuda_tests(out)
        _dump(out, "tests.json", kit.tests)
        return kit.tests["ok"], f"{kit.tests['summary']} (exit {kit.tests['returncode']}; see tests.log)", None

    def exactness_step():
        p = prompts()
        kit.exact = exactness(device, p[:2] if a.tiny else p, tokens=6 if a.tiny else 24)
        _dump(out, "exactness.json", kit.exact)
        return kit.exact["ok"], _fmt_exact(kit.exact), None

    def bench_step():
        from specmoe.bench.runner import run_bench
        from specmoe.bench.widen import widened_copy
        from specmoe.engine.llm import default_model_path
        cache = Path(a.cache_dir)
        cache.mkdir(parents=True, exist_ok=True)
        wpath, winfo = widened_copy(default_model_path(), cache_dir=cache, hidden=1024 if a.tiny else 4096,
                                    expert_mb=0.25 if a.tiny else 24.0, check_prompts=prompts()[:2 if a.tiny else 4],
                                    progress=not a.tiny, device=str(device))
        budget = a.budget_s if a.budget_s is not None else (120.0 if a.tiny else 330.0)
        cfg = bench_config(out, device, wpath, a.tiny, budget, cache)
        command = "benchmarks/gpu/run.sh " + " ".join(argv if argv is not None else sys.argv[1:])
        kit.res = run_bench(cfg, command=command)
        ok, detail = bench_status(kit.res)
        return ok, detail, None

    kit.step("machine", machine_step)
    kit.step("tests", tests_step)
    kit.step("exactness", exactness_step)
    kit.step("bench", bench_step)
    print(f"[{len(STEPS) + 1}/{len(STEPS) + 1}] summary", flush=True)
    print(kit.write())
    if kit.failed:
        print(f"error: kit step(s) failed: {', '.join(kit.failed)} (see summary.md and each step's files in {out})",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
