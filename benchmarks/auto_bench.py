"""`decoding="auto"` against every non-speculative system and every fixed speculative configuration.

    .venv/bin/python benchmarks/auto_bench.py [--model demo|widened] [--batches 1,4,16,64] [--rounds 5]
        [--max-tokens 32] [--dtype float32] [--fixed self,eagle,ngram] [--out benchmarks/results/auto_bench.json]
    .venv/bin/python benchmarks/auto_bench.py --readme-only   # rewrite docs/speculation.md's auto tables from the JSON

Decode tokens/s (the tokens after each sequence's first, over the decode steps' time; end-to-end tok/s with the
prefill is recorded beside it). Disk tier (direct reads), expert cache 25% of the experts per layer, greedy, EOS
ignored, held-out prompts (benchmarks/prompts: code and prose domains taken in turn); a round runs at least
`--seqs-per-round` (16) sequences at each system, in at least `--batches-per-round` (4) whole batches (batch 1: 16
requests one after another; batch 4: 4 batches; batch 16: 4 batches of 16). Systems: the non-speculative baselines
(S3-FIFO, the disk tier's default cache policy, LRU, LFU, adaptive, on-demand), `auto`, the fixed speculative
configurations drafter × γ {2, 4} × {chain, tree} (auto and these on the tier's default policy), and an A/A control (a
second engine identical to the first baseline: the run's noise floor). Every run of every system is checked token for
token against plain decoding (the first baseline) in fp32. `--warmup-steps N` warms every system with rounds shaped
like the measured ones on fresh held-out prompts until auto has taken N steps (its exploration is free in its first 64
steps, then bounded to 4%). Rounds are interleaved (round r runs every system once, in an order shuffled with seed r,
so no system always runs first or last or after the same system: with the order rotated, eagle-g2 ran right after auto
in every round); auto's ratios are medians over rounds of its tok/s ÷ the other system's in the same round (the
machine's speed drifts between rounds), and the best baseline and best fixed configuration are the ones with the
highest median tok/s (beside it, the fixed configuration a user would have picked by hand: the fastest on the warm-up
prompts, other text than the measured rounds', and auto's ratio to it); only ratios within one invocation mean
something (identical runs minutes apart on this kind of machine differ by up to 1.5×). What `auto` chose is recorded
from its stats: share of plain steps, rows per drafter, τ per drafter, bytes per token."""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from specmoe import LLM  # noqa: E402
from specmoe.bench.measure import measure  # noqa: E402
from specmoe.bench.machine import machine_info  # noqa: E402
from specmoe.bench.plots import plot_or_skip  # noqa: E402
from specmoe.engine.auto import controller_of  # noqa: E402
from specmoe.engine.llm import default_model_path  # noqa: E402

BASELINES = {"s3fifo": {"cache_policy": "s3fifo", "decoding": "ar"}, "lru": {"cache_policy": "lru", "decoding": "ar"},
             "lfu": {"cache_policy": "lfu", "decoding": "ar"},
             "adaptive": {"cache_policy": "adaptive", "decoding": "ar"},
             "ondemand": {"cache_policy": "ondemand", "decoding": "ar"}}
# the A/A control: a second engine identical to the first baseline, measured like every system; how far the two
# differ is this run's noise floor (identical engines differed by up to 1.24x on medians of 3 rounds here)
CONTROL = "control"


def is_fixed(name: str) -> bool:
    """A fixed speculative configuration (not a baseline, auto or the A/A control)."""
    return name not in BASELINES and name not in ("auto", CONTROL)
DOMAINS = ("code", "bible", "docs", "fortunes")
AUTO_KEEP = ("controller_steps", "controller_reasons", "controller_rows_by_drafter", "drafters", "tokens_per_step",
             "ar_steps", "steps", "plain_step_share", "expert_bytes_per_token", "acceptance_calibrated_by_drafter",
             "acceptance_plan_calibration_by_drafter",
             "controller_s", "time_refinement", "fwd_refinement", "step_overhead_s_per_token",
             "auto_chosen", "auto_chosen_steps", "auto_current_by_bucket", "auto_exploration_share",
             "auto_exploration_steps", "auto_second_trials", "auto_lap_factors", "auto_lap_pricing",
             "auto_measured_rates", "auto_measured_steps", "auto_miss_moment", "auto_moment_cv",
             "auto_arm_calibration", "controller_arm_rates")


def paired(tps: dict, a: str, b: str) -> float:
    """Median over rounds of a's tok/s ÷ b's in the same round: the machine's speed drifts between rounds (every
    system slower in one round than in the next), and a ratio within one round cancels that drift."""
    return statistics.median(x / y for x, y in zip(tps[a], tps[b]))


def unmeasured(res: dict) -> list[int]:
    """The batch sizes a results file's command asked for that it has no point for (a run stopped early keeps the
    points it finished: `save`)."""
    cmd = res.get("command", "").split()
    asked = cmd[cmd.index("--batches") + 1].split(",") if "--batches" in cmd[:-1] else []
    done = {p["batch"] for p in res["points"]}
    return [int(b) for b in asked if b.isdigit() and int(b) not in done]


def held_pick(p: dict, names) -> tuple[str, float] | None:
    """Of `names`, the system fastest on the warm-up prompts of point p (its `warmup_tok_s`: other text than the
    measured rounds'), and auto ÷ it over the measured rounds (`paired`); None where the warm-up did not rate them
    all. The best of several systems on the measured rounds is partly the luckiest on them (5 baselines with an A/A
    noise floor of 1.12x: their best median is biased up); the one picked beforehand is not."""
    held = p.get("warmup_tok_s") or {}
    names = [n for n in names if n in p["tok_s_per_round"]]
    if not names or not all(n in held for n in names):
        return None
    n = max(names, key=lambda k: held[k])
    return n, paired(p["tok_s_per_round"], "auto", n)


def noise_floor(tps: dict, a: str, b: str) -> float:
    """Median over rounds of the larger ÷ the smaller tok/s of two identical engines a, b (≥ 1)."""
    return statistics.median(max(x, y) / min(x, y) for x, y in zip(tps[a], tps[b]))


def prediction_error(st: dict) -> dict:
    """Median absolute relative error of the controller's step-time predictions, per step kind, over the
    measured rounds' steps (`step_predictions`: kind, B, predicted s, raw s, measured s, ...)."""
    out = {}
    for kind in ("plain", "spec"):
        rows = [p for p in st.get("step_predictions", []) if p[0] == kind and p[4] > 0]
        out[kind] = {"steps": len(rows), "median_abs_error": statistics.median(abs(p[2] - p[4]) / p[4] for p in rows)
                     if rows else None}
    return out


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    pts = res["points"]
    names = list(pts[0]["median_tok_s"])
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for n in names:
        style = dict(lw=2.5, color="black") if n == "auto" else dict(lw=1, alpha=0.7)
        ax.plot([p["batch"] for p in pts], [p["median_tok_s"][n] for p in pts], "o-", label=n, **style)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("batch size")
    ax.set_ylabel("decode tokens/s (median of rounds)")
    ax.set_title(f"auto vs baselines and fixed speculation: {res['model']} model, disk tier, {res['dtype']}")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def fixed_systems(drafters: list[str]) -> dict[str, dict]:
    out = {}
    for d in drafters:
        for g in (2, 4):
            for tree in (False, True):
                out[f"{d}-g{g}{'-tree' if tree else ''}"] = {"decoding": "specmoe", "drafter": d,
                                                             "num_draft_tokens": g, "draft_tree": tree}
    return out


def prompts_for(tokenizer, n: int, *, warmup: bool = False) -> list[list[int]]:
    """The first n measured prompts, round-robin over the domains; `warmup`: n from the other end of the files
    (never measured)."""
    by = {d: [json.loads(x)["prompt"] for x in (REPO / "benchmarks" / "prompts" / f"{d}.jsonl").read_text()
              .splitlines()] for d in DOMAINS}
    cols = list(zip(*by.values()))
    if warmup:
        cols = cols[::-1]
    return [tokenizer.encode(p) for row in cols for p in row][:n]


def prompt_count() -> int:
    """How many distinct prompts `prompts_for` can give (whole rows of the domains, as it takes them)."""
    return len(DOMAINS) * min(len((REPO / "benchmarks" / "prompts" / f"{d}.jsonl").read_text().splitlines())
                              for d in DOMAINS)


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    except OSError:
        return "unknown"


def model_path(name: str, cache: Path, dtype: str) -> Path:
    if name == "demo":
        return default_model_path()
    from specmoe.bench.widen import widened_copy
    return widened_copy(default_model_path(), cache_dir=cache)[0]


def batches(prompts: list, B: int) -> list[list]:
    """`prompts` in consecutive batches of B (a round's, or a warm-up round's, generate calls)."""
    return [prompts[i:i + B] for i in range(0, len(prompts), B)]


def disk_tier(model: str, cache: Path, dtype: str, threads: int = 1):
    """(the model's path, its config, its tokenizer, the tier options) of the disk tier the auto benches run on:
    expert cache at 25% of the experts per layer (at least top-k), no prefetch, repacked experts under `cache`."""
    path = model_path(model, cache, dtype)
    probe = LLM(str(path), threads=threads, dtype=dtype)
    cfg, tok = probe.config, probe.tokenizer
    del probe
    return path, cfg, tok, {"offload": "disk", "cache_experts": max(cfg.top_k, cfg.num_experts // 4),
                            "prefetch": "none", "repack_dir": str(cache / "repack")}


BEGIN, END = "<!-- auto-bench:begin (generated by benchmarks/auto_bench.py) -->", "<!-- auto-bench:end -->"
DOC = REPO / "docs" / "speculation.md"  # the page that carries the generated tables (README.md until it got too long)


def readme_block(results: list[dict]) -> str:
    lines = [BEGIN, ""]
    for res in results:
        size = "at the measured batch size " if res.get("warmup_batch") == "measured" else ""
        warm = (f", after a {res['warmup_tokens']}-token warm-up {size}on held-out prompts (auto's memory cleared at "
                f"the start of the run)" if "warmup_tokens" in res else "")
        if "warmup_steps" in res:
            warm = (f", after warm-up rounds shaped like the measured ones on held-out prompts until auto had taken "
                    f"{res['warmup_steps']} steps (every system runs the same rounds; auto's memory cleared at the start "
                    f"of the run)")
        fixed = sorted(n for n in res["points"][0]["median_tok_s"] if is_fixed(n))
        load = (res["machine"].get("loadavg_at_start") or ["?"])[0]
        order = "shuffled" if all("order_per_round" in p for p in res["points"]) else "rotated"  # (older runs rotated)
        seqs = res.get("seqs_per_round", res.get("seqs_at_batch_1", 4))  # (older runs: one batch a round above 1)
        nb = res.get("batches_per_round", 1)
        lines += [f"`{res['model']}` model, disk tier, cache {res['cache_experts']} experts/layer, {res['dtype']}, "
                  f"{res['max_tokens']} tokens per prompt, at least {seqs} sequences and {nb} whole "
                  f"batch{'es' if nb > 1 else ''} a round, median of {res['rounds']} interleaved rounds (the systems in "
                  f"a {order} order each round; auto's ratios: medians of per-round ratios){warm}, "
                  f"{len(fixed)} fixed configurations, commit `{res['commit'][:10]}` (`{res['out']}`), "
                  f"{res['machine'].get('cpu_model', '?')}, load average at the start {load} on "
                  f"{res['machine'].get('usable_cores', '?')} cores (other work on the machine shows in the A/A "
                  f"noise floor)"
                  + (f"; batch {', '.join(map(str, res['rerun']['batches']))} from a rerun at the same commit "
                     f"(`rerun` in the JSON: {res['rerun']['why']})" if res.get("rerun") else "")
                  + (f"; batch {', '.join(map(str, missing))} not measured (the run was stopped before it)"
                     if (missing := unmeasured(res)) else "") + ":", "",
                  "| batch | best baseline | decode tok/s | best fixed speculative | tok/s | auto tok/s | auto ÷ baseline "
                  "| auto ÷ best fixed | baseline picked on the warm-up prompts: auto ÷ it "
                  "| fixed picked on the warm-up prompts: auto ÷ it | A/A noise floor "
                  "| auto plain steps | auto rows by drafter | step-time error plain / spec |",
                  "|---:|---|---:|---|---:|---:|---:|---:|---|---|---:|---:|---|---|"]
        for p in res["points"]:
            a = p["auto_choice"]
            steps = a.get("controller_steps", {})
            plain = steps.get("plain", 0) / max(1, sum(steps.values()))
            rows = ", ".join(f"{k} {v['rows']} (τ {v['tokens_per_step']:.2f})" for k, v in (a.get("drafters") or {}).items()
                             if v["rows"])
            err = p.get("prediction_error", {})
            noise = f"{p['noise_floor']:.2f}×" if p.get("noise_floor") else "–"
            held = (f"{p['fixed_picked_on_warmup']}: {p['auto_vs_fixed_picked_on_warmup']:.2f}×"
                    if p.get("fixed_picked_on_warmup") else "–")
            hb = held_pick(p, BASELINES)
            held_base = f"{hb[0]}: {hb[1]:.2f}×" if hb else "–"
            e = " / ".join("–" if (err.get(k) or {}).get("median_abs_error") is None
                           else f"{err[k]['median_abs_error']:.0%}" for k in ("plain", "spec"))
            lines.append(f"| {p['batch']} | {p['best_baseline']} | {p['median_tok_s'][p['best_baseline']]:.1f} | "
                         f"{p['best_fixed']} | {p['median_tok_s'][p['best_fixed']]:.1f} | "
                         f"{p['median_tok_s']['auto']:.1f} | {p['auto_vs_baseline']:.2f}× | {p['auto_vs_fixed']:.2f}× | "
                         f"{held_base} | {held} | {noise} | {a.get('plain_step_share', plain):.0%} | {rows} | {e} |")
        lines.append("")
    return "\n".join(lines + [END])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="demo", choices=("demo", "widened"))
    ap.add_argument("--batches", default="1,4,16,64")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--seqs-per-round", type=int, default=16,
                    help="each round runs at least this many sequences: batch B runs ceil(N / B) batches of B distinct "
                         "prompts (one batch of 4 lasted ~0.5 s a round, and the A/A noise floor there read 1.14-1.17)")
    ap.add_argument("--batches-per-round", type=int, default=4,
                    help="... and at least this many whole batches of B (one batch of 16 lasted ~1 s a round, and the "
                         "fixed eagle-g2 read 217-602 tok/s over 5 rounds at batch 16, A/A noise floor 1.12)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--fixed", default="self,eagle,ngram", help="drafters of the fixed configurations")
    ap.add_argument("--baselines", default="s3fifo,lru,lfu,adaptive,ondemand")
    ap.add_argument("--no-control", dest="control", action="store_false",
                    help="leave out the A/A control (a second engine identical to the first baseline)")
    ap.add_argument("--only", default=None, help="keep only these fixed configurations (e.g. self-g4,eagle-g4)")
    ap.add_argument("--warmup-steps", type=int, default=0,
                    help="warm up with rounds shaped like the measured ones (same batch, max tokens) on fresh held-out "
                         "prompts until auto has taken this many steps (every system runs the same rounds; 0: one "
                         "--warmup-tokens generation instead)")
    ap.add_argument("--warmup-tokens", type=int, default=32,
                    help="every system first generates this many tokens for `batch` held-out prompts at once (the "
                         "steady state: caches, calibration and auto's estimates at this batch size)")
    ap.add_argument("--cache-dir", default="/tmp/specmoe-auto-bench")
    ap.add_argument("--out", default=None)
    ap.add_argument("--readme-only", action="store_true",
                    help="only rewrite the auto-bench block of docs/speculation.md from "
                    "benchmarks/results/auto_bench_*.json")
    args = ap.parse_args()
    tag = {"bfloat16": "bf16", "float32": "fp32", "float16": "fp16"}.get(args.dtype, args.dtype)
    out = Path(args.out or REPO / "benchmarks" / "results" / f"auto_bench_{args.model}_{tag}.json")
    if args.readme_only:
        files = sorted((REPO / "benchmarks" / "results").glob("auto_bench_*.json"))
        text = DOC.read_text()
        i, j = text.index(BEGIN), text.index(END) + len(END)
        DOC.write_text(text[:i] + readme_block([json.loads(f.read_text()) for f in files]) + text[j:])
        return 0
    torch.set_num_threads(args.threads)
    cache = Path(args.cache_dir)
    # the engine's user cache (cost-model calibration, auto's memory) lives in the bench's cache; auto's memory
    # starts empty, so each point's auto starts from what this run's earlier points (and its warm-up) saved
    os.environ["XDG_CACHE_HOME"] = str(cache / "xdg")
    shutil.rmtree(cache / "xdg" / "specmoe" / "auto", ignore_errors=True)
    path, cfg, tok, tier = disk_tier(args.model, cache, args.dtype, args.threads)
    ce = tier["cache_experts"]
    systems = {n: BASELINES[n] for n in args.baselines.split(",")}
    systems["auto"] = {"decoding": "auto"}  # (auto and the fixed configurations: the tier's default cache policy)
    fixed_all = fixed_systems(args.fixed.split(","))
    systems |= {n: o for n, o in fixed_all.items() if args.only is None or n in args.only.split(",")}
    ref = args.baselines.split(",")[0]
    if args.control:
        systems[CONTROL] = BASELINES[ref]
    points, t_start, code, warm_rounds = [], time.perf_counter(), commit(), {}  # the code this run loaded (not HEAD at its end)
    machine = machine_info()  # (its load average: the machine's at the start)

    def save() -> dict:  # after every point: a run cut short keeps the points it finished
        res = {"command": "python " + " ".join(sys.argv), "commit": code, "machine": machine,
               "model": args.model, "model_path": str(path), "dtype": args.dtype, "tier": "disk", "cache_experts": ce,
               "max_tokens": args.max_tokens, "rounds": args.rounds, "seqs_per_round": args.seqs_per_round,
               "batches_per_round": args.batches_per_round,
               **({"warmup_steps": args.warmup_steps, "warmup_rounds": warm_rounds} if args.warmup_steps else
                  {"warmup_tokens": args.warmup_tokens}), "warmup_batch": "measured",
               "auto_memory": "cleared at start; each point's auto engine starts from what earlier points saved",
               "elapsed_s": time.perf_counter() - t_start,
               "out": str(out.relative_to(REPO)) if out.is_relative_to(REPO) else str(out), "points": points}
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(res, indent=1, default=str) + "\n")
        return res

    for B in [int(b) for b in args.batches.split(",")]:
        llms = {n: LLM(str(path), threads=args.threads, dtype=args.dtype, **tier, **o) for n, o in systems.items()}
        per = B * max(-(-args.seqs_per_round // B), args.batches_per_round)  # a round's sequences: whole batches
        prompts = prompts_for(tok, per)
        groups = batches(prompts, B)
        held = {n: [0, 0.0] for n in systems}  # decode tokens and seconds over the warm-up rounds after the first
        if args.warmup_steps:  # rounds like the measured ones, on fresh held-out prompts, until auto is past them
            # (from the files' other end, never reaching the measured prompts)
            pool, k, ctl = prompts_for(tok, prompt_count() - per, warmup=True), 0, controller_of(llms["auto"])
            # (at least 2 rounds: the first warms caches and kernels, the rest rate the fixed configurations)
            while (ctl.measured.steps < args.warmup_steps or k < 2) and (k + 1) * per <= len(pool):
                warm = pool[k * per:(k + 1) * per]
                for n, llm in llms.items():
                    for group in batches(warm, B):
                        r = measure(llm, group, args.max_tokens, instrument=False)
                        if k:  # (the first round warms caches and kernels)
                            held[n][0] += r["generated_tokens"] - r["batch"]
                            held[n][1] += r["stats"]["decode_time_s"]
                k += 1
            warm_rounds[B] = k
            print(f"B={B}: {k} warm-up rounds, auto took {ctl.measured.steps} steps", flush=True)
        else:
            warm = prompts_for(tok, per, warmup=True)
            warm = batches(warm, B)
            for llm in llms.values():  # warm-up on held-out prompts: calibration, affinity tables, caches, acceptance
                for group in warm:
                    measure(llm, group, args.warmup_tokens, instrument=False)
        warmed = controller_of(llms["auto"]).warmed
        tps = {n: [] for n in systems}  # decode tokens/s (the first token of each sequence is the prefill's)
        e2e = {n: [] for n in systems}  # generated tokens / generate wall, prefill included
        equal, last = {}, {}
        per_round = []  # what auto ran in each measured round: arm -> steps (its warm-up steps excluded)
        orders = []  # the order the systems ran in, each round
        for rnd in range(args.rounds):
            outs = {}
            # a fresh order each round (seeded by the round): a rotation kept each system's predecessor, and
            # eagle-g2 ran right after auto in every round
            order = list(llms)
            random.Random(rnd).shuffle(order)
            orders.append(order)
            for n in order:
                llm = llms[n]
                llm.reset_stats()
                before = dict(controller_of(llm).measured.chosen) if n == "auto" else None
                runs = [measure(llm, g, args.max_tokens, instrument=False) for g in groups]
                if before is not None:
                    after = controller_of(llm).measured.chosen
                    per_round.append({a: c - before.get(a, 0) for a, c in after.items() if c > before.get(a, 0)})
                outs[n] = [t for r in runs for t in r.pop("_token_ids")]
                gen, wall = sum(r["generated_tokens"] for r in runs), sum(r["wall_s"] for r in runs)
                dec = sum(r["generated_tokens"] - r["batch"] for r in runs)
                dec_s = sum(r["stats"]["decode_time_s"] for r in runs)
                tps[n].append(dec / dec_s)
                e2e[n].append(gen / wall)
                last[n] = llm.stats
                print(f"{args.model} B={B} round={rnd} {n:14s} decode {dec / dec_s:8.2f} tok/s "
                      f"(end to end {gen / wall:8.2f})", flush=True)
            for n in systems:
                equal[n] = equal.get(n, True) and outs[n] == outs[ref]
        med = {n: statistics.median(v) for n, v in tps.items()}
        base = max(args.baselines.split(","), key=lambda n: med[n])
        fixed = [n for n in systems if is_fixed(n)]
        best_fixed = max(fixed, key=lambda n: med[n]) if fixed else "auto"
        # the configuration a user would pick by hand: the fastest on the warm-up prompts (other text than the
        # measured rounds'; the best of 12 on the measured text is partly the luckiest on that text)
        on_held = {n: t / s for n, (t, s) in held.items() if s > 0}
        picked = max(fixed, key=lambda n: on_held[n]) if fixed and all(n in on_held for n in fixed) else None
        st = last["auto"]
        points.append({"batch": B, "prediction_error": prediction_error(st), "tok_s_per_round": tps,
                       "median_tok_s": med,
                       "end_to_end_tok_s_per_round": e2e,
                       "end_to_end_median_tok_s": {n: statistics.median(v) for n, v in e2e.items()},
                       "best_baseline": base,
                       "best_fixed": best_fixed, "auto_vs_baseline": paired(tps, "auto", base),
                       "auto_vs_fixed": paired(tps, "auto", best_fixed),
                       "warmup_tok_s": on_held, "fixed_picked_on_warmup": picked,
                       "auto_vs_fixed_picked_on_warmup": paired(tps, "auto", picked) if picked else None,
                       "ratio_of_medians": {"auto_vs_baseline": med["auto"] / med[base],
                                            "auto_vs_fixed": med["auto"] / med[best_fixed]},
                       "equal_to_plain": equal,
                       "noise_floor": noise_floor(tps, ref, CONTROL) if CONTROL in med else None,
                       "hit_rate": {n: last[n].get("hit_rate") for n in systems},
                       "tokens_per_step": {n: last[n].get("tokens_per_step") for n in systems},
                       "auto_choice": {k: st.get(k) for k in AUTO_KEEP},
                       "auto_steps_per_round": per_round, "order_per_round": orders,
                       "auto_acceptance_from_memory": warmed})
        pt = points[-1]
        hb = held_pick(pt, args.baselines.split(","))
        print(f"B={B}: auto {med['auto']:.1f} tok/s = {pt['auto_vs_baseline']:.2f}x {base}, "
              + (f"{hb[1]:.2f}x {hb[0]} (the baseline fastest on the warm-up prompts), " if hb else "") +
              f"{pt['auto_vs_fixed']:.2f}x {best_fixed} (medians of per-round ratios); "
              + (f"{pt['auto_vs_fixed_picked_on_warmup']:.2f}x {picked} (fastest on the warm-up prompts); "
                 if picked else "")
              + f"all equal: {all(equal.values())}; A/A noise floor {pt['noise_floor'] or 0:.2f}x", flush=True)
        del llms
        res = save()
    res = res if points else save()
    png = out.with_suffix(".png")
    png = None if plot_or_skip(plot, res, png) is False else png
    print(f"wrote {out}{f' and {png}' if png else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
