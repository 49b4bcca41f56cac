"""An MoE checkpoint larger than RAM, streamed from SSD at batch 1: specmoe against llama.cpp (issues 26, 36).

    .venv/bin/python benchmarks/over_ram.py --model mid --workload natural-forced,sampled --limits 1.5x,2x,3x \\
        --llama-cpp-src ~/.cache/specmoe/llama_cpp_python-0.3.36 [--repeats 3] [--max-tokens 160]
    .venv/bin/python benchmarks/over_ram.py --dry-run      # the whole pipeline on a tiny widened copy, minutes

Model (--model): a function-preserving widened copy of the demo model (specmoe.bench.overram_runs: `big` hidden
4096 with 144 MiB experts, ~27 GiB; `mid` hidden 4096 with 48 MiB experts, ~9 GiB; `dry` a tiny copy), with its
specmoe repack and llama.cpp bf16 GGUF, built once under --cache-dir (outside the repository).

Workloads (--workload), batch 1, the same documents for every system (specmoe.bench.documents):
- natural-forced: held-out natural documents (2 per domain of benchmarks/prompts by default), a --prompt-tokens
  prompt and --max-tokens forced tokens each: specmoe runs SamplingParams(forced_tokens=...) (speculative systems
  accept a draft where it equals the document's token); llama.cpp evaluates the same tokens one llama_decode each;
- sampled: temperature --temperature with a fixed seed per document, the same prompts;
- greedy: argmax (issue 26's workload, where the text loops).
A run is a fresh process that goes through every document one after another; its tok/s are summed over them (first
--window tokens of each document, and the rest: steady).

Memory limit (--limits, model ÷ limit: 1.5x, 2x, 3x, or none): each run of either system goes into its own cgroup v1
memory cgroup (specmoe.bench.cgroup) with memory.limit_in_bytes = model bytes ÷ N (+ --limit-floor, for the dry
run's tiny model that torch alone outweighs); its memory.stat, max usage, failcnt and OOM counters are recorded. Where
the controller is absent or this is not root, the block falls back to a balloon process leaving model ÷ N of RAM,
labelled `limit: balloon`, and says why. specmoe's memory budget (--budgets `limit`) = the limit − the non-expert
weights in the compute dtype − --headroom, recorded per run. A run the kernel kills for memory is recorded as
status "oom", one the engine refuses as "refused" with its line. Every cgroup and balloon made is removed on exit,
also on Ctrl-C and SIGTERM.

Protocol: --repeats repeats, the systems' order alternated; every run after the model files were dropped from the
page cache (their residency recorded before and after); median and spread per system. Results:
benchmarks/results/over_ram.json (+ png; the block in docs/over_ram.md through overram_report.write_readme).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from specmoe.bench import cgroup, overram_runs, sysprobe  # noqa: E402
from specmoe.bench.documents import build_documents  # noqa: E402
from specmoe.bench.overram_report import LLAMA, plot, ratios, summarize, targets, write_readme  # noqa: E402
from specmoe.bench.plots import plot_or_skip  # noqa: E402
from specmoe.bench.machine import machine_info, provenance  # noqa: E402
from specmoe.bench.peers import find_convert_script  # noqa: E402
from specmoe.errors import InputError  # noqa: E402

GiB = 1 << 30
DOMAINS = ("code", "bible", "docs", "fortunes")


def documents_of(tokenizer, args) -> list[dict]:
    """--documents held-out documents (domains in turn) of --prompt-tokens + --max-tokens tokens; each with the
    seed its sampled run uses (1000 + its index)."""
    per = -(-args.documents // len(DOMAINS))
    docs = build_documents(tokenizer.encode, REPO / "benchmarks" / "prompts", per_domain=per,
                           prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens)[: args.documents]
    return [{**d.to_dict(), "seed": 1000 + i} for i, d in enumerate(docs)]


# ---------------------------------------------------------------- stage: prepare (its own process)
def prepare(args) -> dict:
    from specmoe.engine.llm import default_model_path
    from specmoe.tokenizer import Tokenizer
    src = default_model_path()
    sizes = overram_runs.MODELS[args.model]
    cache = Path(args.cache_dir)
    t0 = time.perf_counter()
    art = overram_runs.build_artifacts(src, cache, sizes, gguf=args.gguf, llama_src=args.llama_cpp_src,
                                  progress=not args.dry_run, dtype=args.dtype)
    art["prepare_s"] = time.perf_counter() - t0
    art["documents"] = documents_of(Tokenizer.load(Path(art["path"])), args)
    art["warm_caches"] = overram_runs.warm_caches(Path(art["path"]), cache / "repack", art["documents"][0]["prompt"],
                                                  args.dtype)
    art["resolved_dtype"] = art["warm_caches"].get("dtype", "float32")
    if args.costs:
        art["costs"] = overram_runs.cost_profile(Path(art["path"]), cache / "repack")
    return art


def run_prepare(args, log: Path) -> dict:
    """`prepare` in a child process, so the parent stays small while the systems run."""
    import subprocess
    argv = [sys.executable, __file__, "--stage", "prepare", *args.passthrough]
    with open(log, "a") as errf:
        proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=errf, text=True)
    lines = [x for x in proc.stdout.splitlines() if x.startswith(overram_runs.RESULT_TAG)]
    if proc.returncode != 0 or not lines:
        sys.stderr.write(log.read_text()[-3000:])
        raise SystemExit(f"building the artifacts failed (exit status {proc.returncode}); log: {log}")
    return json.loads(lines[-1][len(overram_runs.RESULT_TAG):])


# ---------------------------------------------------------------- runs
def parse_budget(text: str, expert_total: int) -> int | str:
    from specmoe.options import size
    t = text.strip()
    if t == "llama":
        return t
    if t.endswith("%"):
        return int(float(t[:-1]) / 100 * expert_total)
    return size(t)


def agreement(tokens: list[list[int]], ref: list[list[int]]) -> dict:
    """Token agreement over every document: identical, matching positions, and each document's common prefix."""
    return {"identical": tokens == ref,
            "common_prefix": [next((i for i, (a, b) in enumerate(zip(t, f)) if a != b), min(len(t), len(f)))
                              for t, f in zip(tokens, ref)],
            "matching_positions": sum(a == b for t, f in zip(tokens, ref) for a, b in zip(t, f)),
            "of": sum(len(f) for f in ref)}


def limit_factor(text: str) -> float | None:
    """'2x' -> 2.0 (model ÷ limit), 'none' -> None."""
    t = text.strip()
    if t == "none":
        return None
    if not t.endswith("x"):
        raise InputError(f"--limits: {t!r} is not 'none' or Nx (model ÷ limit, e.g. 2x)")
    try:
        f = float(t[:-1])
    except ValueError:
        raise InputError(f"--limits: {t!r} is not 'none' or Nx (model ÷ limit, e.g. 2x)") from None
    if f <= 0:
        raise InputError(f"--limits: {t!r} must be above 0x")
    return f


def limit_plan(args, plan: dict, text: str) -> dict:
    """How block `text` limits memory: {"limit": "cgroup" | "balloon" | "none", "limit_bytes", "factor", why}."""
    f = limit_factor(text)
    if f is None:
        return {"limit": "none", "factor": None, "limit_bytes": None, "name": text}
    limit = int(plan["model_bytes"] / f + args.limit_floor_gib * GiB)
    why = cgroup.unavailable(Path(args.cgroup_root)) if args.limit_kind != "balloon" else "--limit-kind balloon"
    if why is None:
        return {"limit": "cgroup", "factor": f, "limit_bytes": limit, "name": text}
    if args.limit_kind == "cgroup":
        return {"limit": "skipped", "factor": f, "limit_bytes": limit, "name": text, "reason": why}
    return {"limit": "balloon", "factor": f, "limit_bytes": limit, "name": text, "cgroup_unavailable": why}


def specmoe_budget(args, art: dict, lp: dict, bname: str, budget) -> tuple[int | None, dict]:
    """(memory_budget, how): a fixed budget as given; `limit`: the limit − non-expert weights in the compute dtype
    − --headroom (None without a limit: the engine's default sizing)."""
    if budget != "limit":
        return budget, {"from": bname}
    if lp["limit_bytes"] is None:
        return None, {"from": "no limit: the engine's default"}
    ne = art["plan"]["non_expert_bytes"] * (2 if args.resolved_dtype == "float32" else 1)
    b = lp["limit_bytes"] - ne - int(args.headroom_gib * GiB)
    return max(b, 1), {"from": "limit", "limit_bytes": lp["limit_bytes"], "non_expert_compute_bytes": ne,
                       "headroom_bytes": int(args.headroom_gib * GiB), "computed_bytes": b}


def run_block(args, art: dict, workload: str, limit_text: str, llama_reason: str | None, log: Path,
              seq: list[int]) -> dict:
    """Every system × budget on `workload` under limit `limit_text`, `args.repeats` times in alternating order."""
    plan = art["plan"]
    files = {"repack": Path(art["repack"]["file"])}
    if "gguf" in art:
        files["gguf"] = Path(art["gguf"]["file"])
    for i, s in enumerate(art["safetensors"]):
        files[f"safetensors{i}"] = Path(s["file"])
    device = sysprobe.device_of(files["repack"])
    names = args.budgets.split(",")
    bmap = {n: ("limit" if n == "limit" else parse_budget(n, plan["expert_total_bytes"])) for n in names}
    spec_systems = [s for s in args.systems.split(",") if s != LLAMA]
    order = ([LLAMA] if LLAMA in args.systems.split(",") else []) + \
        [(s, n) for n in names if bmap[n] != "llama" for s in spec_systems] + \
        [(s, n) for n in names if bmap[n] == "llama" for s in spec_systems]
    lp = limit_plan(args, plan, limit_text)
    docs = [{"prompt": d["prompt"], "forced": d["forced"], "seed": d["seed"]} for d in art["documents"]]
    block = {"workload": workload, "limit": lp["limit"], "limit_plan": lp, "prompts": len(docs),
             "max_tokens": args.max_tokens, "prompt_tokens": args.prompt_tokens,
             "temperature": args.temperature if workload == "sampled" else 0.0}
    if lp["limit"] == "skipped":
        print(f"== {workload} @ {limit_text}: skipped: {lp['reason']}", flush=True)
        return {**block, "label": f"{limit_text} (skipped)", "skipped": lp["reason"]}
    gib = 0.0
    if lp["limit"] == "balloon":
        gib = max(0.0, (sysprobe.meminfo()["MemTotal"] - lp["limit_bytes"]) / GiB)
    runs: list[dict] = []
    with sysprobe.Balloon(gib, args.floor_gib) as bl:
        ram = lp["limit_bytes"] if lp["limit_bytes"] is not None else sysprobe.meminfo()["MemTotal"]
        label = {"cgroup": f"cgroup limit {ram / GiB:.2f} GiB", "none": "no limit",
                 "balloon": f"balloon (emulated {ram / GiB:.2f} GiB; {lp.get('cgroup_unavailable')})"}[lp["limit"]]
        block.update(label=f"{workload}, {label}", balloon=bl.info, ram_bytes=ram,
                     model_over_ram=plan["model_bytes"] / ram)
        print(f"== {block['label']}: model {plan['model_bytes'] / GiB:.2f} GiB = {block['model_over_ram']:.2f}x",
              flush=True)
        for r in range(args.repeats):
            for item in (order if r % 2 == 0 else order[::-1]):
                row = {"repeat": r, "workload": workload, "limit": lp["limit"], "label": block["label"]}
                if item == LLAMA:
                    row.update(system=LLAMA, budget=None)
                    if llama_reason:
                        runs.append({**row, "status": "skipped", "reason": llama_reason})
                        continue
                    spec = {"gguf": str(files["gguf"]), "docs": docs, "max_tokens": args.max_tokens,
                            "threads": args.threads, "window": args.window, "workload": workload,
                            "temperature": args.temperature}
                    argv, env = overram_runs.llama_argv(spec), overram_runs.llama_env(args.llama_site)
                else:
                    sysname, bname = item
                    row.update(system=f"{sysname}@{bname}", budget=bname)
                    budget = bmap[bname]
                    if budget == "llama":
                        budget, why = footprint_budget(runs, names, bmap, spec_systems)
                        if budget is None:
                            runs.append({**row, "status": "skipped", "reason": why})
                            print(f"  r{r} {row['system']:>16s}: skipped: {why}", flush=True)
                            continue
                        row["budget_bytes_derived"] = why
                    budget, how = specmoe_budget(args, art, lp, bname, budget)
                    row["memory_budget_bytes"], row["budget_how"] = budget, how
                    spec = {"path": art["path"], "repack_dir": str(Path(args.cache_dir) / "repack"),
                            "memory_budget": budget, "system": sysname, "docs": docs, "workload": workload,
                            "temperature": args.temperature, "max_tokens": args.max_tokens, "threads": args.threads,
                            "window": args.window, "io_depth": args.io_depth, "dtype": args.dtype}
                    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
                    argv = overram_runs.specmoe_argv(spec)
                seq[0] += 1
                if lp["limit"] == "cgroup":
                    with cgroup.MemCgroup(f"specmoe-overram-{os.getpid()}-{seq[0]}", lp["limit_bytes"],
                                          Path(args.cgroup_root)) as cg:
                        res = overram_runs.run_child(argv, env=env, files=files, device=device, log=log,
                                                     timeout=args.child_timeout, cgroup=cg)
                else:
                    res = overram_runs.run_child(argv, env=env, files=files, device=device, log=log,
                                                 timeout=args.child_timeout)
                row.update(res)
                if row.get("status") == "ok" and row.get("tokens"):
                    dev = row.get("device_read_bytes")
                    row["device_read_bytes_per_token"] = (None if dev is None else
                                                          max(0, dev - row.get("load_read_bytes", 0)) / row["tokens"])
                runs.append(row)
                print(f"  r{r} {row['system']:>16s}: {describe(row)}", flush=True)
                if not bl.alive and gib > 0:
                    raise SystemExit("the balloon process died during the run")
    for r in range(args.repeats):  # agreement with llama.cpp's tokens, else the first specmoe system's, same repeat
        ok = [x for x in runs if x["repeat"] == r and x.get("status") == "ok"]
        ref = next((x for x in ok if x["system"] == LLAMA), ok[0] if ok else None)
        for x in ok:
            x["agreement"] = {"reference": ref["system"], **agreement(x["token_ids"], ref["token_ids"])}
    block["runs"] = runs
    block["summary"] = summarize(runs)
    block["ratios"] = ratios(block["summary"], names, spec_systems, args.fixed)
    block["targets"] = targets(block, names)
    return block


def footprint_budget(runs: list[dict], names: list[str], bmap: dict, spec_systems: list[str]):
    """(budget, how) = llama.cpp's steady footprint − specmoe's non-expert footprint, or (None, why not)."""
    llama = next((x for x in runs if x["system"] == LLAMA and x.get("status") == "ok"), None)
    if llama is None:
        return None, "llama.cpp's footprint is unknown (no llama.cpp run succeeded in this block)"
    first = next((n for n in names if bmap[n] != "llama"), None)
    ref = next((x for x in runs if first and x["system"] == f"{spec_systems[0]}@{first}" and x.get("status") == "ok"),
               None)
    if ref is None:
        return None, "specmoe's non-expert footprint is unknown (no run at a fixed budget succeeded in this block)"
    overhead = ref["steady_footprint_bytes"] - ref["expert_memory_bytes"]
    budget = int(llama["steady_footprint_bytes"] - overhead)
    if budget <= 0:
        return None, (f"llama.cpp's steady footprint ({llama['steady_footprint_bytes'] / GiB:.2f} GiB) is below specmoe's "
                      f"non-expert footprint ({overhead / GiB:.2f} GiB): no room for experts at that footprint")
    return budget, {"llama_steady_footprint_bytes": llama["steady_footprint_bytes"],
                    "specmoe_non_expert_footprint_bytes": overhead, "from": ref["system"]}


def describe(row: dict) -> str:
    if row.get("status") != "ok":
        return f"{row.get('status')}: {row.get('reason', '')[:300]}"
    f = lambda v, d=2: "–" if v is None else f"{v:.{d}f}"  # noqa: E731
    return (f"first {f(row.get('first_tok_s'))} tok/s, steady {f(row.get('steady_tok_s'))} tok/s, "
            f"read {f((row.get('steady_read_bytes_per_token') or 0) / 2**20, 1)} MiB/token, "
            f"hit {f(row.get('hit_rate'))}, peak anon {row['peak_rss_anon_bytes'] / GiB:.2f} GiB, "
            f"file {row['peak_rss_file_bytes'] / GiB:.2f} GiB, min avail {row['min_mem_available_bytes'] / GiB:.2f} GiB")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="the whole pipeline on a tiny widened copy (--model dry)")
    ap.add_argument("--model", default=None, choices=sorted(overram_runs.MODELS),
                    help="the widened copy: big (~27 GiB), mid (~9 GiB), dry (tiny); default big, dry run dry")
    ap.add_argument("--cache-dir", default=None, help="artifacts (default ~/.cache/specmoe/overram[-dry]; --model mid: "
                    "~/.cache/specmoe, where vs_llamacpp.py builds that copy)")
    ap.add_argument("--workload", default="natural-forced,sampled", help="natural-forced, sampled, greedy (comma list)")
    ap.add_argument("--documents", type=int, default=8, help="documents per run, the domains in turn (default 8)")
    ap.add_argument("--temperature", type=float, default=0.8, help="the sampled workload's temperature")
    ap.add_argument("--systems", default=None, help=f"default {LLAMA},lru,auto")
    ap.add_argument("--fixed", default="eagle-g4", help="the fixed speculative system's name, for its ratio to LRU")
    ap.add_argument("--budgets", default="limit", help="specmoe memory budgets: 'limit' (the limit − non-expert "
                    "weights − --headroom), sizes, shares of the expert bytes, or 'llama' (default limit)")
    ap.add_argument("--limits", default=None, help="model ÷ memory limit per block: Nx or none (default 1.5x,2x,3x)")
    ap.add_argument("--limit-kind", default="auto", choices=("auto", "cgroup", "balloon"),
                    help="auto: a cgroup where the controller is usable, else a balloon (labelled)")
    ap.add_argument("--cgroup-root", default=str(cgroup.ROOT))
    ap.add_argument("--limit-floor-gib", type=float, default=None, help="added to every limit (default 0; dry run "
                    "1.5: torch alone outweighs the tiny model)")
    ap.add_argument("--headroom-gib", type=float, default=1.0, help="what the 'limit' budget leaves for the "
                    "interpreter, torch, the KV cache and I/O buffers")
    ap.add_argument("--floor-gib", type=float, default=3.0, help="least MemAvailable a balloon may leave")
    ap.add_argument("--max-tokens", type=int, default=None, help="forced / sampled tokens per document (default 160; "
                    "dry run 24)")
    ap.add_argument("--window", type=int, default=None, help="first-window tokens (default 32; dry run 8)")
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=None, help="default 3; dry run 1")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default="auto", help="specmoe's compute dtype (default auto: the engine's rule, bf16 "
                    "where this CPU's bf16 matmul is fast, else fp32; experts stay bf16 on disk either way)")
    ap.add_argument("--io-depth", type=int, default=1)
    ap.add_argument("--llama-site", default=os.environ.get("SPECMOE_LLAMA_SITE"),
                    help="a directory with llama_cpp installed (pip install --target), put on the llama.cpp child's "
                    "PYTHONPATH (env SPECMOE_LLAMA_SITE)")
    ap.add_argument("--llama-cpp-src", default=None, help="llama-cpp-python's sdist (its convert_hf_to_gguf.py)")
    ap.add_argument("--no-costs", dest="costs", action="store_false", help="skip the per-expert cost profile")
    ap.add_argument("--child-timeout", type=float, default=3600.0)
    ap.add_argument("--out", default=None, help="results JSON (default benchmarks/results/over_ram.json; dry run: "
                    "the cache dir)")
    ap.add_argument("--readme-only", action="store_true",
                    help="rewrite the over-RAM block of docs/over_ram.md (no longer README.md) from --out's JSON")
    ap.add_argument("--stage", default="all", choices=("all", "prepare"), help=argparse.SUPPRESS)
    ap.add_argument("--gguf", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.readme_only:
        write_readme(json.loads(Path(args.out or REPO / "benchmarks" / "results" / "over_ram.json").read_text()))
        return 0
    dry = args.dry_run
    args.model = args.model or ("dry" if dry else "big")
    home = Path.home() / ".cache" / "specmoe"
    args.cache_dir = args.cache_dir or str(home if args.model == "mid" else home / ("overram-dry" if dry else "overram"))
    args.systems = args.systems or f"{LLAMA},lru,auto"
    args.limits = args.limits or "1.5x,2x,3x"
    args.limit_floor_gib = args.limit_floor_gib if args.limit_floor_gib is not None else (1.5 if dry else 0.0)
    args.max_tokens = args.max_tokens or (24 if dry else 160)
    args.window = args.window or (8 if dry else 32)
    args.repeats = args.repeats or (1 if dry else 3)
    workloads = [w.strip() for w in args.workload.split(",") if w.strip()]
    bad = [w for w in workloads if w not in ("natural-forced", "sampled", "greedy")]
    if bad or not workloads:
        raise SystemExit(f"--workload: unknown {bad or workloads}; expected natural-forced, sampled, greedy")
    try:
        [limit_factor(x) for x in args.limits.split(",")]
    except InputError as e:
        raise SystemExit(str(e)) from None
    if args.window >= args.max_tokens:
        raise SystemExit("--window must be below --max-tokens")
    if args.documents < 1:
        raise SystemExit("--documents must be at least 1")
    if args.stage == "prepare":
        print(overram_runs.RESULT_TAG + json.dumps(prepare(args), default=str), flush=True)
        return 0
    cgroup.install_signal_exit()  # SIGTERM / SIGHUP unwind through the cgroups' and balloons' cleanup
    cache = Path(args.cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    log = cache / "over_ram.log"
    out = Path(args.out) if args.out else (cache / "over_ram_dry.json" if dry else
                                             REPO / "benchmarks" / "results" / "over_ram.json")
    t_start = time.perf_counter()
    llama_reason = None
    if LLAMA in args.systems.split(","):
        llama_reason = overram_runs.llama_available(args.llama_site)
        if llama_reason is None:  # importable: the GGUF needs llama.cpp's converter too
            try:
                find_convert_script(Path(args.cache_dir), args.llama_cpp_src)
            except FileNotFoundError as e:
                llama_reason = str(e)
        if llama_reason:
            print(f"{LLAMA} rows skipped: {llama_reason}", flush=True)
    args.gguf = int(LLAMA in args.systems.split(",") and llama_reason is None)
    args.passthrough = [a for a in (argv if argv is not None else sys.argv[1:])] + ["--gguf", str(args.gguf),
                                                                                  "--cache-dir", args.cache_dir]
    art = run_prepare(args, log)
    args.resolved_dtype = art.get("resolved_dtype", "float32")
    print(f"artifacts ready in {art['prepare_s']:.0f} s: {art['path']}", flush=True)
    blocks, seq = [], [0]
    for w in workloads:
        for lim in args.limits.split(","):
            try:
                blocks.append(run_block(args, art, w, lim.strip(), llama_reason, log, seq))
            except InputError as e:  # the balloon's guard: this block cannot run here; the others still do
                print(f"== {w} @ {lim}: skipped: {e}", flush=True)
                blocks.append({"workload": w, "limit": "skipped", "label": f"{w}, {lim} (skipped)", "skipped": str(e)})
            # after every block: a later crash keeps these
            png = write(args, art, blocks, out, argv, t_start, llama_reason)
    print(f"wrote {out}{f' and {png}' if png else ''} in {time.perf_counter() - t_start:.0f} s")
    return 0


def write(args, art: dict, blocks: list[dict], out: Path, argv, t_start: float, llama_reason) -> Path | None:
    """The results JSON, then its plot (None: not drawn, matplotlib missing; the JSON is written either way)."""
    res = {"command": "python " + " ".join([str(Path(__file__).relative_to(REPO))] + (argv or sys.argv[1:])),
           "dry_run": args.dry_run, "commit": provenance()["git_commit"], "provenance": provenance(),
           "machine": machine_info(art["path"]),
           "flags": {k: getattr(args, k) for k in ("model", "workload", "documents", "temperature", "systems", "fixed",
                                                   "budgets", "limits", "limit_kind", "limit_floor_gib",
                                                   "headroom_gib", "max_tokens", "window", "prompt_tokens", "repeats",
                                                   "threads", "io_depth", "floor_gib", "dtype")},
           "llama_cpp": {"skipped_reason": llama_reason, "site": args.llama_site,
                         "version": None if llama_reason else overram_runs.llama_version(args.llama_site)},
           "artifacts": {k: v for k, v in art.items() if k != "documents"}, "documents": art["documents"],
           "blocks": blocks, "elapsed_s": time.perf_counter() - t_start}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, default=str) + "\n")
    png = out.with_suffix(".png")
    return None if plot_or_skip(plot, res, png) is False else png


if __name__ == "__main__":
    sys.exit(main())
