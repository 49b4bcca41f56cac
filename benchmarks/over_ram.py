"""An MoE checkpoint larger than RAM, streamed from SSD at batch 1: specmoe against llama.cpp (issue 26).

    .venv/bin/python benchmarks/over_ram.py --llama-site /work/llamacpp-site \\
        --llama-cpp-src /path/llama_cpp_python-0.3.36.tar.gz [--balloons 0,2x] [--repeats 3] [--max-tokens 160]
    .venv/bin/python benchmarks/over_ram.py --dry-run      # the whole pipeline on a tiny widened copy, minutes

The model is a function-preserving widened copy of the demo model (hidden 4096, 144 MiB experts, ~29 GB in bf16:
specmoe.bench.overram_runs), with its specmoe repack and llama.cpp bf16 GGUF, built once under --cache-dir (outside the
repository). Every run is a fresh process, after the GGUF, the repack and the copy's weight files were dropped from
the page cache (their residency is recorded before and after); batch 1, a 32-token prompt (benchmarks/prompts,
a different one per repeat), greedy, --max-tokens new tokens. tok/s is reported over the first --window tokens
(time from the request, prefill included) and over the tokens after them (steady). Systems: llama.cpp
(llama-cpp-python, default mmap, --threads threads; rows say why when it is not importable), specmoe LRU, `auto`
and a fixed speculative system (--fixed) on the disk tier at each --budgets memory budget: a size, a share of the
expert bytes ("30%"), or "llama" = llama.cpp's measured steady footprint (RssAnon + RssFile) less specmoe's own
non-expert footprint (measured in the first budget's LRU run). Repeats alternate the order of the systems.
--balloons runs the whole set again with a balloon process holding that many GiB ("2x": the balloon that makes
the model twice the remaining RAM), labelled "emulated smaller RAM" in every output.

Per run: tok/s (first window, steady), bytes the process read from storage per token (/proc/<pid>/io
read_bytes: O_DIRECT reads and mmap page faults alike; over the timed windows) and the device's (/proc/diskstats over
the whole child process, its load included; every process on the device counts),
hit rate, peak and sampled RSS (anon, file), lowest MemAvailable, residency of the files after, and agreement
of the generated tokens with llama.cpp's (else the first specmoe system's).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from specmoe.bench import overram_runs, sysprobe  # noqa: E402
from specmoe.bench.overram_report import LLAMA, plot, ratios, summarize, targets, write_readme  # noqa: E402
from specmoe.bench.plots import plot_or_skip  # noqa: E402
from specmoe.bench.machine import machine_info, provenance  # noqa: E402
from specmoe.bench.peers import find_convert_script  # noqa: E402
from specmoe.errors import InputError  # noqa: E402

GiB = 1 << 30
DOMAINS = ("code", "bible", "docs", "fortunes")


def prompts_of(tokenizer, n: int, length: int) -> list[list[int]]:
    """`n` prompts of exactly `length` tokens: the held-out prompts (domains in turn) long enough, cut."""
    by = {d: [json.loads(x)["prompt"] for x in (REPO / "benchmarks" / "prompts" / f"{d}.jsonl").read_text().splitlines()]
          for d in DOMAINS}
    out = []
    for row in zip(*by.values()):
        for text in row:
            ids = tokenizer.encode(text)
            if len(ids) >= length:
                out.append(ids[:length])
            if len(out) == n:
                return out
    raise InputError(f"only {len(out)} prompts of ≥ {length} tokens in benchmarks/prompts")


# ---------------------------------------------------------------- stage: prepare (its own process)
def prepare(args) -> dict:
    from specmoe.engine.llm import default_model_path
    from specmoe.tokenizer import Tokenizer
    src = default_model_path()
    sizes = overram_runs.DRY if args.dry_run else overram_runs.BIG
    cache = Path(args.cache_dir)
    t0 = time.perf_counter()
    art = overram_runs.build_artifacts(src, cache, sizes, gguf=args.gguf, llama_src=args.llama_cpp_src,
                                  progress=not args.dry_run, dtype=args.dtype)
    art["prepare_s"] = time.perf_counter() - t0
    art["prompts"] = prompts_of(Tokenizer.load(Path(art["path"])), args.repeats, args.prompt_tokens)
    art["warm_caches"] = overram_runs.warm_caches(Path(art["path"]), cache / "repack", art["prompts"][0], args.dtype)
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


def balloon_gib(text: str, model_bytes: int) -> float:
    """'0', '9.5' (GiB) or '2x' (the balloon that leaves model_bytes / 2 of RAM)."""
    t = text.strip()
    if t.endswith("x"):
        return max(0.0, (sysprobe.meminfo()["MemTotal"] - model_bytes / float(t[:-1])) / GiB)
    return float(t)


def agreement(tokens: list[int], ref: list[int]) -> dict:
    prefix = next((i for i, (a, b) in enumerate(zip(tokens, ref)) if a != b), min(len(tokens), len(ref)))
    return {"identical": tokens == ref, "common_prefix": prefix,
            "matching_positions": sum(a == b for a, b in zip(tokens, ref)), "of": len(ref)}


def run_block(args, art: dict, gib: float, llama_reason: str | None, log: Path) -> dict:
    """Every system × budget, `args.repeats` times in alternating order, under a balloon of `gib` GiB."""
    plan = art["plan"]
    files = {"repack": Path(art["repack"]["file"])}
    if "gguf" in art:
        files["gguf"] = Path(art["gguf"]["file"])
    for i, s in enumerate(art["safetensors"]):
        files[f"safetensors{i}"] = Path(s["file"])
    device = sysprobe.device_of(files["repack"])
    budgets = [parse_budget(b, plan["expert_total_bytes"]) for b in args.budgets.split(",")]
    names = [b for b in args.budgets.split(",")]
    spec_systems = [s for s in args.systems.split(",") if s != LLAMA]
    order = ([LLAMA] if LLAMA in args.systems.split(",") else []) + \
        [(s, n) for b, n in zip(budgets, names) if b != "llama" for s in spec_systems] + \
        [(s, n) for b, n in zip(budgets, names) if b == "llama" for s in spec_systems]
    bmap = dict(zip(names, budgets))
    runs: list[dict] = []
    with sysprobe.Balloon(gib, args.floor_gib) as bl:
        block = {"balloon": bl.info, "label": sysprobe.label(gib),
                 "ram_bytes": sysprobe.meminfo()["MemTotal"] - int(gib * GiB)}
        block["model_over_ram"] = plan["model_bytes"] / block["ram_bytes"]
        print(f"== {block['label']}: model {plan['model_bytes'] / GiB:.1f} GiB = {block['model_over_ram']:.2f}x RAM",
              flush=True)
        for r in range(args.repeats):
            prompt = art["prompts"][r % len(art["prompts"])]
            for item in (order if r % 2 == 0 else order[::-1]):
                row = {"repeat": r, "balloon_gib": gib, "label": block["label"]}
                if item == LLAMA:
                    row.update(system=LLAMA, budget=None)
                    if llama_reason:
                        runs.append({**row, "status": "skipped", "reason": llama_reason})
                        continue
                    spec = {"gguf": str(files["gguf"]), "prompt": prompt, "max_tokens": args.max_tokens,
                            "threads": args.threads, "window": args.window}
                    res = overram_runs.run_child(overram_runs.llama_argv(spec), env=overram_runs.llama_env(args.llama_site),
                                            files=files, device=device, log=log, timeout=args.child_timeout)
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
                    row["memory_budget_bytes"] = budget
                    need = budget + plan["non_expert_bytes"] + GiB  # + torch and the interpreter
                    avail = sysprobe.meminfo()["MemAvailable"]
                    if avail - need < args.floor_gib * GiB:
                        runs.append({**row, "status": "skipped", "reason": (
                            f"MemAvailable {avail / GiB:.2f} GiB - expected private memory {need / GiB:.2f} GiB is below "
                            f"the floor of {args.floor_gib} GiB")})
                        print(f"  r{r} {row['system']:>16s}: skipped: {runs[-1]['reason']}", flush=True)
                        continue
                    spec = {"path": art["path"], "repack_dir": str(Path(args.cache_dir) / "repack"),
                            "memory_budget": budget, "system": sysname, "prompt": prompt,
                            "max_tokens": args.max_tokens, "threads": args.threads, "window": args.window,
                            "io_depth": args.io_depth, "dtype": args.dtype}
                    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
                    res = overram_runs.run_child(overram_runs.specmoe_argv(spec), env=env, files=files, device=device, log=log,
                                            timeout=args.child_timeout)
                row.update(res)
                if row.get("status") == "ok" and row.get("tokens"):
                    row["device_read_bytes_per_token"] = (row["device_read_bytes"] / row["tokens"]
                                                          if row.get("device_read_bytes") is not None else None)
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
    block["full_run_estimate"] = estimate(runs, args)
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


def estimate(runs: list[dict], args, tokens: int = 160, window: int = 32, repeats: int = 3) -> dict:
    """Wall seconds this block would take at `tokens` new tokens, `window`, `repeats` (the full run's defaults),
    from these runs: per run, its process time outside generation (start, load, cache drop) + `window` tokens at
    its first-window rate + the rest at its steady rate; skipped runs count nothing."""
    per = {}
    for x in runs:
        if x.get("status") == "ok" and x.get("steady_tok_s") and x.get("first_tok_s"):
            t = (x["process_wall_s"] - x["wall_s"]) + window / x["first_tok_s"] + (tokens - window) / x["steady_tok_s"]
            per.setdefault(x["system"], []).append(t)
    one = {k: statistics.median(v) for k, v in per.items()}
    return {"per_run_s": one, "block_s": repeats * sum(one.values()), "tokens": tokens, "window": window,
            "repeats": repeats, "from": {"max_tokens": args.max_tokens, "window": args.window}}


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
    ap.add_argument("--dry-run", action="store_true", help="the whole pipeline on a tiny widened copy")
    ap.add_argument("--cache-dir", default=None, help="artifacts (default ~/.cache/specmoe/overram[-dry])")
    ap.add_argument("--systems", default=None, help=f"default {LLAMA},lru,auto,<--fixed>")
    ap.add_argument("--fixed", default="eagle-g4", help="the fixed speculative system (auto_bench's names)")
    ap.add_argument("--budgets", default=None, help="memory budgets: sizes, shares of the expert bytes, or 'llama' "
                    "(default 8GiB,llama; dry run 30%%,llama)")
    ap.add_argument("--balloons", default="0", help="GiB held by a balloon per block, or Nx (model = N x RAM)")
    ap.add_argument("--floor-gib", type=float, default=3.0, help="least MemAvailable a balloon / run may leave")
    ap.add_argument("--max-tokens", type=int, default=None, help="new tokens per run (default 160; dry run 24)")
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
    ap.add_argument("--readme-only", action="store_true", help="rewrite README.md's over-RAM table from --out's JSON")
    ap.add_argument("--stage", default="all", choices=("all", "prepare"), help=argparse.SUPPRESS)
    ap.add_argument("--gguf", type=int, default=1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.readme_only:
        write_readme(json.loads(Path(args.out or REPO / "benchmarks" / "results" / "over_ram.json").read_text()),
                     REPO / "README.md")
        return 0
    dry = args.dry_run
    args.cache_dir = args.cache_dir or str(Path.home() / ".cache" / "specmoe" / ("overram-dry" if dry else "overram"))
    args.systems = args.systems or f"{LLAMA},lru,auto,{args.fixed}"
    args.budgets = args.budgets or ("30%,llama" if dry else "8GiB,llama")
    args.max_tokens = args.max_tokens or (24 if dry else 160)
    args.window = args.window or (8 if dry else 32)
    args.repeats = args.repeats or (1 if dry else 3)
    if args.window >= args.max_tokens:
        raise SystemExit("--window must be below --max-tokens")
    if args.stage == "prepare":
        print(overram_runs.RESULT_TAG + json.dumps(prepare(args), default=str), flush=True)
        return 0
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
    print(f"artifacts ready in {art['prepare_s']:.0f} s: {art['path']}", flush=True)
    blocks = []
    for b in args.balloons.split(","):
        gib = balloon_gib(b, art["plan"]["model_bytes"])
        try:
            blocks.append(run_block(args, art, gib, llama_reason, log))
        except InputError as e:  # the balloon's guard: this block cannot run here; the others still do
            print(f"== {sysprobe.label(gib)}: skipped: {e}", flush=True)
            blocks.append({"label": sysprobe.label(gib), "balloon": {"gib": gib}, "skipped": str(e)})
        # after every block: a later crash keeps these
        png = write(args, art, blocks, out, argv, t_start, llama_reason)
    print(f"wrote {out}{f' and {png}' if png else ''} in {time.perf_counter() - t_start:.0f} s")
    return 0


def write(args, art: dict, blocks: list[dict], out: Path, argv, t_start: float, llama_reason) -> Path | None:
    """The results JSON, then its plot (None: not drawn, matplotlib missing; the JSON is written either way)."""
    res = {"command": "python " + " ".join([str(Path(__file__).relative_to(REPO))] + (argv or sys.argv[1:])),
           "dry_run": args.dry_run, "commit": provenance()["git_commit"], "provenance": provenance(),
           "machine": machine_info(art["path"]),
           "flags": {k: getattr(args, k) for k in ("systems", "fixed", "budgets", "balloons", "max_tokens", "window",
                                                   "prompt_tokens", "repeats", "threads", "io_depth", "floor_gib",
                                                   "dtype")},
           "llama_cpp": {"skipped_reason": llama_reason, "site": args.llama_site,
                         "version": None if llama_reason else overram_runs.llama_version(args.llama_site)},
           "artifacts": {k: v for k, v in art.items() if k != "prompts"}, "prompts": art["prompts"],
           "blocks": blocks, "elapsed_s": time.perf_counter() - t_start}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1, default=str) + "\n")
    png = out.with_suffix(".png")
    return None if plot_or_skip(plot, res, png) is False else png


if __name__ == "__main__":
    sys.exit(main())
