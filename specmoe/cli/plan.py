"""`specmoe plan [MODEL]`: predicted tokens/s of plain decoding, an LRU expert cache and SpecMoE by batch size,
for this machine (the cost model calibrated here, cached) and for hardware profiles built from published
figures. Every row is a prediction (labelled so); `specmoe bench` measures."""
from __future__ import annotations

from pathlib import Path

from specmoe.errors import InputError


def _ints(s: str) -> tuple[int, ...]:
    try:
        out = tuple(int(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise InputError(f"expected comma-separated integers, got {s!r}") from None
    if not out or min(out) < 1:
        raise InputError(f"batch sizes must be integers >= 1, got {s!r}")
    return out


def _floats(s: str) -> tuple[float, ...]:
    try:
        out = tuple(float(x) for x in s.split(",") if x.strip())
    except ValueError:
        raise InputError(f"expected comma-separated numbers, got {s!r}") from None
    if not out or not all(0 <= a <= 1 for a in out):
        raise InputError(f"acceptance values must be probabilities in [0, 1], got {s!r}")
    return out


def register(sub) -> None:
    from specmoe.decoding.control.profiles import PROFILES
    p = sub.add_parser("plan", help="predicted tokens/s of plain, LRU and SpecMoE by batch size, here and on "
                       "named hardware", description=__doc__)
    p.add_argument("model", nargs="?", default=None, help="checkpoint directory (default: the bundled demo model)")
    p.add_argument("--offload", default="disk", choices=("disk", "host"),
                   help="this machine's backing tier to calibrate against")
    p.add_argument("--profiles", default="this," + ",".join(PROFILES),
                   help=f"comma-separated: this (calibrated here), {', '.join(PROFILES)}")
    p.add_argument("--batch-sizes", type=str, default="1,4,16,64")
    p.add_argument("--draft-experts", type=int, default=4, help="SpecMoE draft experts N per MoE layer")
    p.add_argument("--num-draft-tokens", type=int, default=4, help="SpecMoE γ_max")
    p.add_argument("--cache-fraction", type=float, default=0.25, help="expert cache per layer, share of experts")
    p.add_argument("--acceptance", type=str, default=None,
                   help="acceptance per draft position, e.g. 0.56,0.38,0.23,0.16 (default: the controller's "
                        "prior, 0.6^(j+1))")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"))
    p.add_argument("--threads", type=int, default=None, help="torch threads while calibrating (default: torch's; "
                   "the calibration is cached per thread count)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.set_defaults(func=run)


def plan_rows(model: str | None, *, profiles: list[str], batches, draft_experts: int, gamma: int,
              cache_fraction: float, acceptance=None, offload: str = "disk", dtype: str = "auto") -> dict:
    import torch

    from specmoe.decoding.control.profiles import PROFILES, coefficients, predict, routing_from_profile
    from specmoe.experts.profiling import load_profile
    from specmoe.weights.checkpoint import Checkpoint, resolve_dtype
    from specmoe.bundled import demo_model_dir
    path = Path(model) if model else demo_model_dir()
    unknown = [p for p in profiles if p != "this" and p not in PROFILES]
    if unknown:
        raise InputError(f"unknown profile(s) {', '.join(unknown)}; choose from this, {', '.join(PROFILES)}")
    if not 0 < cache_fraction <= 1:
        raise InputError(f"--cache-fraction must be in (0, 1], got {cache_fraction}")
    cfg = Checkpoint(path).config
    if not 1 <= draft_experts <= cfg.num_experts or not 1 <= gamma <= 64:
        raise InputError(f"--draft-experts must be in [1, {cfg.num_experts}] and --num-draft-tokens in [1, 64]")
    prof = path / "expert_profile.json"
    counts = load_profile(prof, cfg) if prof.is_file() else None
    slots = max(cfg.top_k, round(cache_fraction * cfg.num_experts))
    out = {"model": str(path), "routing": "expert_profile.json" if counts else "uniform (no expert_profile.json)",
           "acceptance": list(acceptance) if acceptance else "prior 0.6^(j+1)", "cache_slots_per_layer": slots,
           "profiles": {}}
    for name in profiles:
        if name == "this":
            from specmoe import LLM
            from specmoe.engine.auto import controller_of
            with LLM(path, dtype=dtype, offload=offload, decoding="auto", draft_experts=draft_experts,
                     num_draft_tokens=gamma, cache_experts=slots) as llm:
                coef = controller_of(llm).cost.c
            desc = f"this machine, {offload} tier (calibrated: {coef.source})"
        else:
            h = PROFILES[name]
            bytes_per = torch.empty((), dtype=resolve_dtype(dtype, default=cfg.dtype)).element_size()
            coef, desc = coefficients(h, cfg, bytes_per, draft_experts), f"{h.description} — {h.source}"
        rows = predict(coef, routing_from_profile(cfg, counts), batches=batches, draft_experts=draft_experts,
                       gamma=gamma, cache_slots=slots, acceptance=acceptance)
        out["profiles"][name] = {"description": desc, "read_gbps": coef.read_gbps, "rows": rows}
    return out


def run(args) -> int:
    if args.threads is not None:
        if args.threads < 1:
            raise InputError(f"--threads must be >= 1, got {args.threads}")
        import torch
        torch.set_num_threads(args.threads)
    res = plan_rows(args.model, profiles=[p.strip() for p in args.profiles.split(",") if p.strip()],
                    batches=_ints(args.batch_sizes), draft_experts=args.draft_experts, gamma=args.num_draft_tokens,
                    cache_fraction=args.cache_fraction,
                    acceptance=_floats(args.acceptance) if args.acceptance else None, offload=args.offload,
                    dtype=args.dtype)
    if args.json:
        from specmoe.cli.common import print_json
        print_json(res)
        return 0
    print(f"model {res['model']}; routing: {res['routing']}; acceptance: {res['acceptance']}; "
          f"cache {res['cache_slots_per_layer']} experts per layer")
    for name, p in res["profiles"].items():
        print(f"\n{name}: {p['description']}")
        print(f"{'batch':>5s} {'plain tok/s':>12s} {'LRU tok/s':>10s} {'SpecMoE tok/s':>14s} {'γ':>3s} {'N':>3s} "
              f"{'auto picks':>10s}  label")
        for r in p["rows"]:
            print(f"{r['batch']:5d} {r['plain_tok_s']:12.1f} {r['lru_tok_s']:10.1f} {r['specmoe_tok_s']:14.1f} "
                  f"{r['gamma']:3d} {r['draft_experts']:3d} {r['choice']:>10s}  {r['label']}")
    return 0
