"""`specmoe bench`: sweep systems × tiers × batch sizes (+ SpecMoE sweeps, peers, a widened
model) and write results.json and PNG plots into --out."""
from __future__ import annotations

import shlex
import sys


def _ints(s: str) -> tuple[int, ...]:
    return tuple(int(x) for x in s.split(",") if x.strip())


def _names(s: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in s.split(",") if x.strip() and x.strip() != "none")


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmark every available system (tokens/s, bytes moved, hit rate, τ)",
                       description=__doc__)
    g = p.add_mutually_exclusive_group()
    g.add_argument("--quick", dest="preset", action="store_const", const="quick",
                   help="≈3 min on a 2-core machine: batch 1 and 16, a few systems, short sweeps (default)")
    g.add_argument("--full", dest="preset", action="store_const", const="full",
                   help="≈30 min: batch 1–256, every system, both tiers, full sweeps, peers, widened model")
    g.add_argument("--headline", dest="preset", action="store_const", const="headline",
                   help="≤25 min: what the README's Results block is generated from (`make bench`): disk tier, "
                        "the headline baselines at batch 1–256, peers, widened model; no sweeps")
    p.add_argument("--model", default=None, help="checkpoint directory (default: the bundled demo model)")
    p.add_argument("--out", default="benchmarks/results", help="output directory for results.json and PNGs")
    p.add_argument("--dtype", default=None, choices=("auto", "float32", "bfloat16", "float16"),
                   help="compute dtype (default: the checkpoint's)")
    p.add_argument("--systems", type=_names, default=None,
                   help="comma-separated systems (see --list; default: the preset's)")
    p.add_argument("--tiers", type=_names, default=None, help="comma-separated tiers: disk,host (host = emulated link)")
    p.add_argument("--batch-sizes", type=_ints, default=None, help="comma-separated batch sizes")
    p.add_argument("--max-tokens", type=int, default=None, help="tokens generated per sequence (EOS ignored)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="prompts truncated to this many tokens")
    p.add_argument("--cache-fraction", type=float, default=None, help="expert cache per layer as a share of experts")
    p.add_argument("--link-gbps", type=float, default=None, help="host tier: emulated link bandwidth, GB/s")
    p.add_argument("--link-latency-us", type=float, default=None, help="host tier: emulated per-transfer latency, µs")
    p.add_argument("--sweep-batch", type=int, default=None, help="batch size of the γ / N / policy sweeps")
    p.add_argument("--gammas", type=_ints, default=None, help="γ values of the τ-vs-γ sweep")
    p.add_argument("--draft-experts", type=_ints, default=None, help="N values of the draft-experts sweep")
    p.add_argument("--peers", type=_names, default=None, help="comma-separated peers: hf,hf-offload,llama.cpp (none: skip)")
    p.add_argument("--peer-batches", type=_ints, default=None, help="batch sizes for the peers")
    p.add_argument("--widened", action="store_true", default=None, help="also run the widened copy of the model")
    p.add_argument("--no-widened", dest="widened", action="store_false", help="skip the widened model")
    p.add_argument("--widened-batches", type=_ints, default=None, help="batch sizes for the widened model")
    p.add_argument("--cache-dir", default=None, help="built artefacts: widened model, GGUF (default ~/.cache/specmoe)")
    p.add_argument("--llama-cpp-src", default=None, help="llama-cpp-python sdist (.tar.gz or dir) with convert_hf_to_gguf.py")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--time-budget", type=float, default=None, help="seconds; later points are marked skipped")
    p.add_argument("--no-plots", dest="plots", action="store_false", default=None, help="skip the PNG plots")
    p.add_argument("--control", action="store_true",
                   help="when to speculate: auto vs every baseline at batch 1-64 (demo + widened, disk), predicted vs "
                        "measured step time, the φ sweep over emulated link speeds, steady state (control.json, "
                        "control.md, phi_sweep.png in --out)")
    p.add_argument("--control-sections", type=_names, default=None,
                   help="with --control: comma-separated subset of systems,plaincost,phi,steady (the other sections "
                        "of an existing control.json are kept)")
    p.add_argument("--list", action="store_true", help="list the registered systems and whether this build runs them")
    p.add_argument("--json", action="store_true", help="print the headline rows as JSON")
    p.set_defaults(func=run, preset=None)


def list_systems() -> int:
    from specmoe.bench import systems as S
    setting = S.Setting("disk", 8)
    for s in S.SYSTEMS:
        why = S.availability(s, setting, expert_bytes=1, num_moe_layers=1)
        print(f"{s.name:18s} {s.label:28s} {'available' if not why else 'not available in this build: ' + why}")
    return 0


def summary(res: dict) -> str:
    lines = [f"{'model':8s} {'tier':6s} {'system':18s} {'batch':>5s} {'tok/s':>9s} {'decode tok/s':>12s} "
             f"{'bytes/tok':>11s} {'hit':>6s} {'τ':>5s} status"]
    for r in res["runs"]:
        if "sweep" in r:
            continue
        f = lambda k, fmt: (fmt.format(r[k]) if r.get(k) is not None else "-")  # noqa: E731
        st = r["status"] if r["status"] == "ok" else f"{r['status']}: {r.get('reason', '')[:70]}"
        lines.append(f"{r['model']:8s} {r['tier']:6s} {r['system']:18s} {r['batch']:5d} {f('tokens_per_s', '{:9.1f}'):>9s} "
                     f"{f('decode_tokens_per_s', '{:12.1f}'):>12s} {f('bytes_per_token', '{:11.0f}'):>11s} "
                     f"{f('hit_rate', '{:6.2f}'):>6s} {f('tokens_per_step', '{:5.2f}'):>5s} {st}")
    for p in res.get("peers", []):
        tps = f"{p['tokens_per_s']:9.1f}" if p.get("tokens_per_s") is not None else "        -"
        st = p["status"] if p["status"] == "ok" else f"{p['status']}: {p.get('reason', '')[:90]}"
        lines.append(f"{'peer':8s} {'':6s} {p['peer']:18s} {p.get('batch', 0):5d} {tps} {st}")
    return "\n".join(lines)


def run_control(args) -> int:
    from specmoe.bench.auto_control import ControlConfig, run_control as run
    from specmoe.errors import InputError
    cfg = ControlConfig(out=args.out)
    if args.control_sections:
        bad = [s for s in args.control_sections if s not in cfg.sections]
        if bad:
            raise InputError(f"--control-sections: unknown {', '.join(bad)}; choose from {', '.join(cfg.sections)}")
        cfg.sections = args.control_sections
    if args.batch_sizes:
        cfg.batches = cfg.widened_batches = args.batch_sizes
    if args.max_tokens:
        cfg.max_tokens = args.max_tokens
    if args.widened is not None:
        cfg.widened = args.widened
    if args.threads:
        cfg.threads = args.threads
    res = run(cfg, command="specmoe " + " ".join(shlex.quote(a) for a in sys.argv[1:]))
    from specmoe.bench.auto_control import report
    print(report(res))
    return 0


def run(args) -> int:
    if args.list:
        return list_systems()
    if args.control:
        return run_control(args)
    from specmoe.bench import preset, run_bench
    overrides = {k: getattr(args, a) for k, a in (
        ("model", "model"), ("out", "out"), ("dtype", "dtype"), ("systems", "systems"), ("tiers", "tiers"),
        ("batch_sizes", "batch_sizes"), ("max_tokens", "max_tokens"), ("prompt_tokens", "prompt_tokens"),
        ("cache_fraction", "cache_fraction"), ("link_gbps", "link_gbps"), ("link_latency_us", "link_latency_us"),
        ("sweep_batch", "sweep_batch"), ("gammas", "gammas"), ("draft_experts", "draft_experts"), ("peers", "peers"),
        ("peer_batches", "peer_batches"), ("widened", "widened"), ("widened_batches", "widened_batches"),
        ("cache_dir", "cache_dir"), ("llama_cpp_src", "llama_cpp_src"), ("threads", "threads"),
        ("time_budget_s", "time_budget"), ("plots", "plots"))}
    if args.systems:
        overrides["tier_systems"] = {}  # an explicit --systems applies to every tier
    cfg = preset(args.preset or "quick", **overrides)
    res = run_bench(cfg, command="specmoe " + " ".join(shlex.quote(a) for a in sys.argv[1:]))
    if args.json:
        from specmoe.cli.common import print_json
        print_json({"out": cfg.out, "headline": res["headline"]})
    else:
        print(summary(res))
        print(f"\nwrote {cfg.out}/results.json and {len(res.get('plots', {}))} plot(s) in {res['elapsed_s']:.0f} s")
    return 0
