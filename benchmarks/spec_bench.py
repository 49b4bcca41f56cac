"""SpecMoE sweeps on one model: τ over γ × N, draft-set policies (paper Table II), N sweep
(Table III), substitution rules, and tokens/s + bytes/token of SpecMoE vs AR baselines with
experts on the disk tier. Not a test: it prints tables and writes `--out` JSON.

    .venv/bin/python benchmarks/spec_bench.py [--model DIR] [--out results.json] [--threads 1]
        [--sections tau,policy,nsweep,subst,throughput] [--prompts 16] [--max-tokens 32]

Every run is greedy with EOS ignored, on the same prompts (benchmarks/prompts/*.jsonl, domains
interleaved; random token ids for a model without tokenizer). τ (tokens per step) counts the
correction/bonus token; acceptance_per_position[j] = share of sequence-steps whose j-th draft
was accepted (so τ = 1 + Σ_j acc[j] when no step is cut short by max_tokens).
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from specmoe import LLM, SamplingParams  # noqa: E402
from specmoe.bench.machine import provenance  # noqa: E402
from specmoe.options import SpecConfig  # noqa: E402


def load_prompts(llm: LLM, n: int, seed: int = 0) -> list:
    """n prompts, domains round-robin; token-id prompts when the model has no tokenizer."""
    files = sorted((REPO / "benchmarks" / "prompts").glob("*.jsonl"))
    per = []
    for f in files:
        rows = [json.loads(line) for line in f.read_text().splitlines() if line.strip()]
        per.append([r["prompt"] for r in rows if r.get("prompt")])
    out = []
    if per and llm.tokenizer is not None:
        i = 0
        while len(out) < n and any(per):
            lst = per[i % len(per)]
            if lst:
                out.append(lst.pop(0))
            i += 1
    if len(out) < n:
        r = random.Random(seed)
        V = llm.config.vocab_size
        out += [[r.randrange(V) for _ in range(r.randint(8, 32))] for _ in range(n - len(out))]
    return out


def run(llm: LLM, prompts: list, max_tokens: int, spec: SpecConfig, temperature: float = 0.0) -> dict:
    """One generation (greedy unless temperature > 0) with the given strategy, swapped into the LLM in place."""
    llm.spec_cfg = spec
    pin = getattr(llm.store, "pin", None)
    if pin is not None:  # every run starts from a cold cache without an earlier run's pinned draft set
        for layer in llm.config.moe_layers:
            pin(layer, [])
        getattr(llm.store, "evict_all", lambda: None)()
    llm.reset_stats()
    t0 = time.perf_counter()
    params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=temperature, seed=i)
              for i in range(len(prompts))]
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    s = llm.stats
    keep = ("decoding", "tokens_per_step", "acceptance_per_position", "draft_set_hit_rate", "draft_time_s",
            "verify_time_s", "accept_time_s", "ar_time_s", "steps", "ar_steps", "decode_steps", "decode_time_s",
            "decode_tokens_per_s", "tokens_per_s", "generated_tokens", "bytes_moved", "bytes_per_token",
            "hit_rate", "fallback_choice", "controller_steps", "controller_reasons", "draft_phase_bytes", "pin_bytes",
            "offload", "cache_policy", "cache_slots_per_layer", "direct_io")
    rec = {k: s[k] for k in keep if k in s}
    rec.update(wall_s=wall, batch=len(prompts), max_tokens=max_tokens, temperature=temperature,
               draft_experts=spec.draft_experts,
               num_draft_tokens=spec.num_draft_tokens, substitution=spec.substitution, draft_policy=spec.draft_policy)
    rec["token_ids_head"] = [o.token_ids[:8] for o in outs[:2]]
    return rec


def table(title: str, header: list[str], rows: list[list]) -> None:
    def f(v):
        if isinstance(v, float):
            return f"{v:.3f}" if abs(v) < 1000 else f"{v:.3g}"
        if isinstance(v, list):
            return "[" + " ".join(f"{x:.2f}" for x in v) + "]"
        return str(v)
    cells = [[f(v) for v in r] for r in rows]
    w = [max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(header)]
    print(f"\n## {title}")
    print("  ".join(h.ljust(w[i]) for i, h in enumerate(header)))
    for c in cells:
        print("  ".join(v.ljust(w[i]) for i, v in enumerate(c)))
    sys.stdout.flush()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="checkpoint dir (default: the bundled demo model)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default=None, help="write all records as JSON here")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: shared machines)")
    ap.add_argument("--sections", default="tau,policy,nsweep,subst,throughput")
    ap.add_argument("--prompts", type=int, default=16,
                    help="prompts (= batch) of the τ / policy / N / substitution runs")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature of the τ / policy / N / substitution runs (0 = greedy; >0 uses "
                         "rejection sampling, seeded per prompt)")
    ap.add_argument("--gammas", default="2,4,6,8,10")
    ap.add_argument("--ns", default="2,4,8,16")
    ap.add_argument("--gamma", type=int, default=4, help="γ of the policy / N / substitution / throughput runs")
    ap.add_argument("--n", type=int, default=4, help="N of the policy / substitution / throughput runs")
    ap.add_argument("--batches", default="1,4,16,64", help="batch sizes of the throughput section")
    ap.add_argument("--tp-max-tokens", type=int, default=24, help="max_tokens of the throughput section")
    ap.add_argument("--offload", default="disk", choices=("disk", "host"), help="tier of the throughput section")
    ap.add_argument("--cache-experts", type=int, default=None, help="cache slots per layer (default: the engine's)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sections = set(args.sections.split(","))
    results = {"command": "python " + " ".join(sys.argv), "provenance": provenance(),
               "machine": {"python": platform.python_version(), "torch": torch.__version__,
                           "threads": torch.get_num_threads(), "cpu": platform.processor() or platform.machine()},
               "args": vars(args)}

    llm = LLM(args.model, dtype=args.dtype, max_batch=max(args.prompts, max(int(b) for b in args.batches.split(","))))
    cfg = llm.config
    E, K = cfg.num_experts, cfg.top_k
    results["model"] = {"path": str(llm.path), "model_type": cfg.model_type, "experts": E, "top_k": K,
                        "moe_layers": len(cfg.moe_layers), "hidden": cfg.hidden_size}
    print(f"model {llm.path} ({cfg.model_type}, E={E}, top-{K}, {len(cfg.moe_layers)} MoE layers), "
          f"threads={torch.get_num_threads()}")
    batches = [int(b) for b in args.batches.split(",")]
    all_prompts = load_prompts(llm, max(args.prompts, *batches))  # distinct prompts up to the largest batch
    prompts = all_prompts[:args.prompts]
    base = SpecConfig(decoding="specmoe", draft_experts=args.n, num_draft_tokens=args.gamma)
    run(llm, prompts[:2], 4, base)  # warm-up (affinity table, allocations)
    ns = sorted({min(int(n), E) for n in args.ns.split(",")})

    if "tau" in sections:
        gammas = [int(g) for g in args.gammas.split(",")]
        recs, rows = [], []
        for n in ns:
            row = [n]
            for g in gammas:
                r = run(llm, prompts, args.max_tokens, replace(base, draft_experts=n, num_draft_tokens=g),
                        args.temperature)
                r["section"] = "tau"
                recs.append(r)
                row.append(r["tokens_per_step"])
            rows.append(row)
        results["tau"] = recs
        table(f"τ (tokens per step) — rows N, columns γ; {base.substitution}, {base.draft_policy}, "
              f"batch {len(prompts)}", ["N \\ γ"] + [str(g) for g in gammas], rows)

    if "policy" in sections:
        recs, rows = [], []
        for pol in ("random", "hot-global", "hot-temporal"):
            r = run(llm, prompts, args.max_tokens, replace(base, draft_policy=pol), args.temperature)
            r["section"] = "policy"
            recs.append(r)
            rows.append([pol, r["tokens_per_step"], r["draft_set_hit_rate"], r["acceptance_per_position"]])
        results["policy"] = recs
        table(f"draft-set policy (paper Table II) — N={args.n}, γ={args.gamma}, {base.substitution}",
              ["policy", "τ", "draft-set hit", "acceptance per position"], rows)

    if "nsweep" in sections:
        recs, rows = [], []
        for n in sorted({1, K, *ns, E}):
            r = run(llm, prompts, args.max_tokens, replace(base, draft_experts=n), args.temperature)
            r["section"] = "nsweep"
            recs.append(r)
            share = r["draft_time_s"] / max(r["draft_time_s"] + r["verify_time_s"], 1e-9)
            rows.append([n, r["tokens_per_step"], r["draft_set_hit_rate"], share, r["decode_tokens_per_s"]])
        results["nsweep"] = recs
        table(f"N sweep (paper Table III) — γ={args.gamma}, {base.substitution}, {base.draft_policy}; "
              "all experts resident", ["N", "τ", "draft-set hit", "draft time share", "decode tok/s"], rows)

    if "subst" in sections:
        recs, rows = [], []
        for n in sorted({1, *[m for m in ns if m < E]}):
            row = [n]
            for sub in ("affinity", "mask", "random"):
                r = run(llm, prompts, args.max_tokens, replace(base, draft_experts=n, substitution=sub),
                        args.temperature)
                r["section"] = "subst"
                recs.append(r)
                row.append(r["tokens_per_step"])
            rows.append(row)
        results["subst"] = recs
        table(f"substitution — τ, γ={args.gamma}, {base.draft_policy}", ["N", "affinity", "mask", "random"], rows)

    if "throughput" in sections:
        results["throughput"] = throughput(args, all_prompts, base)

    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1, default=str))
        print(f"\nwrote {args.out}")


def throughput(args, prompts: list, base: SpecConfig) -> list[dict]:
    """tokens/s and bytes/token, experts on the disk (or host) tier, SpecMoE vs AR + cache policies."""
    batches = [int(b) for b in args.batches.split(",")]
    systems = [("ar", "ondemand"), ("ar", "static"), ("ar", "lru"), ("specmoe", "ondemand"), ("specmoe", "lru"),
               ("auto", "ondemand")]
    recs, rows = [], []
    llms: dict[str, LLM] = {}
    for dec, pol in systems:
        if pol not in llms:
            kw = {"cache_experts": args.cache_experts} if args.cache_experts else {}
            llms[pol] = LLM(args.model, dtype=args.dtype, max_batch=max(batches), offload=args.offload,
                            cache_policy=pol, **kw)
            run(llms[pol], prompts[:2], 4, replace(base, decoding="ar"))  # warm-up (repack, profile)
        llm = llms[pol]
        for B in batches:
            ps = [prompts[i % len(prompts)] for i in range(B)]
            r = run(llm, ps, args.tp_max_tokens, replace(base, decoding=dec))
            r.update(section="throughput", system=f"{dec}+{pol}")
            recs.append(r)
            rows.append([f"{dec}+{pol}", B, r["decode_tokens_per_s"], r.get("bytes_per_token", 0.0) / 2**20,
                         r.get("hit_rate", 0.0), r.get("tokens_per_step", 1.0), r.get("draft_phase_bytes", 0),
                         r.get("fallback_choice", "-")])
    t = recs[0]
    table(f"throughput — experts on the {args.offload} tier ({t.get('cache_slots_per_layer')} cache slots/layer, "
          f"direct_io={t.get('direct_io')}), γ={args.gamma}, N={args.n}, {args.tp_max_tokens} tokens",
          ["system", "batch", "decode tok/s", "MiB/token", "hit rate", "τ", "draft bytes", "auto choice"], rows)
    return recs


if __name__ == "__main__":
    main()
