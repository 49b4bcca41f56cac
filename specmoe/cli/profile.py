"""`specmoe profile`: count which experts the router picks on held-out prompts; write
expert_profile.json (counts + per-layer skewness) and a heatmap PNG (SpecMoE Fig. 6)."""
from __future__ import annotations

from pathlib import Path

from specmoe.cli.common import add_model_args, add_option_args, jsonl_prompt, make_llm, print_json, read_text
from specmoe.bundled import prompts_dir
from specmoe.errors import InputError

PROMPTS_DIR = prompts_dir()


def register(sub) -> None:
    p = sub.add_parser("profile", help="profile expert activations; write expert_profile.json and a heatmap")
    add_model_args(p)
    p.add_argument("--prompts", default=None,
                   help=f"JSONL file (a 'prompt' field per line) or directory of *.jsonl (default: {PROMPTS_DIR} "
                        "when present, else built-in prompts)")
    p.add_argument("--max-prompts", type=int, default=64, help="prompts to run at most")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens generated per prompt (greedy), so decode-time "
                   "routing is profiled too")
    p.add_argument("--out-dir", default="expert-profile", help="where expert_profile.json and the heatmap go "
                   "(copy expert_profile.json into the checkpoint for --cache-policy static)")
    p.add_argument("--json", action="store_true", help="print the profile summary as JSON")
    add_option_args(p)
    p.set_defaults(func=run)


def read_prompts(src: str | None, limit: int) -> tuple[list[str], str]:
    from specmoe.experts.profiling import BUILTIN_PROMPTS
    path = Path(src) if src else PROMPTS_DIR
    if src and not path.exists():
        raise InputError(f"prompts not found: {path}")
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else ([path] if path.is_file() else [])
    per_file = []
    for f in files:
        rows = [jsonl_prompt(line, f"{f}:{i + 1}", ids_ok=False)
                for i, line in enumerate(read_text(f).splitlines()) if line.strip()]
        per_file.append(rows)
    # domains interleaved, so a small --max-prompts still covers every file
    prompts = [rows[i] for i in range(max(map(len, per_file), default=0)) for rows in per_file if i < len(rows)]
    if not prompts:
        return list(BUILTIN_PROMPTS)[:limit], "built-in prompts"
    return prompts[:limit], ", ".join(str(f) for f in files)


def run(args) -> int:
    from specmoe import SamplingParams
    from specmoe.experts.profiling import heatmap, profile_dict, save_profile
    if args.max_prompts < 1:
        raise InputError(f"--max-prompts must be >= 1, got {args.max_prompts}")
    prompts, source = read_prompts(args.prompts, args.max_prompts)
    out = Path(args.out_dir)
    try:  # fail before running the model
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"cannot create the output directory {out}: {e.strerror or e}") from None
    llm = make_llm(args, progress=not args.json)
    if llm.tokenizer is None:
        raise InputError(f"{llm.path} has no tokenizer.json; profiling needs text prompts")
    llm.reset_stats()
    llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0.0), use_tqdm=not args.json)
    s = llm.stats
    counts = s.get("expert_counts")
    if counts is None:
        raise InputError("this expert store does not report expert_counts")
    prof = profile_dict(counts, llm.config, model=str(llm.path), prompts=len(prompts), prompt_source=source,
                        max_tokens=args.max_tokens, generated_tokens=s["generated_tokens"],
                        fingerprint=llm.ckpt.fingerprint())
    if not save_profile(out / "expert_profile.json", prof):
        raise InputError(f"cannot write {out / 'expert_profile.json'}")
    png = heatmap(counts, llm.config, out / "expert_heatmap.png", title=f"{llm.path.name}: expert activation share")
    summary = {"profile": str(out / "expert_profile.json"), "heatmap": str(png), "prompts": len(prompts),
               "prompt_source": source, "skewness_per_layer": prof["skewness"],
               "mean_skewness": sum(prof["skewness"]) / max(1, len(prof["skewness"]))}
    if args.json:
        print_json(summary)
    else:
        for k, v in summary.items():
            print(f"{k:>20}: {v}")
    return 0
