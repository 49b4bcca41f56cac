"""`specmoe perplexity [MODEL] --expert-format checkpoint int8 int4`: held-out perplexity per expert format."""
from __future__ import annotations

from pathlib import Path

from specmoe.cli.common import print_json
from specmoe.experts.formats import FORMATS


def register(sub) -> None:
    p = sub.add_parser("perplexity", help="held-out perplexity of the model with each expert storage format")
    p.add_argument("model", nargs="?", default=None, help="checkpoint directory (default: the demo model)")
    p.add_argument("--expert-format", nargs="+", default=["checkpoint", "int8", "int4"], choices=FORMATS,
                   help="formats to compare; the first is the reference (default: checkpoint int8 int4)")
    p.add_argument("--texts", default=None, help="JSONL file of {\"prompt\": text} rows (default: the bundled "
                   "held-out prompts, every domain)")
    p.add_argument("--per-domain", type=int, default=None, help="use the first N texts of each file")
    p.add_argument("--max-tokens", type=int, default=256, help="tokens scored per text, at most (default 256)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="compute dtype (auto: see docs/models.md)")
    p.add_argument("--repack-dir", default=None, help="where quantized experts are (or go)")
    p.add_argument("--json", action="store_true", help="print as JSON")
    p.set_defaults(func=run)


def run(args) -> int:
    from specmoe.eval.perplexity import compare_formats, load_texts
    from specmoe.options import check_int
    check_int("--per-domain", args.per_domain, 1, none_ok=True)
    check_int("--max-tokens", args.max_tokens, 2)
    texts = load_texts(Path(args.texts) if args.texts else None, per_domain=args.per_domain)
    rows = compare_formats(args.model, args.expert_format, texts=texts, dtype=args.dtype, repack_dir=args.repack_dir,
                           max_tokens=args.max_tokens, progress=True)
    if args.json:
        print_json(rows)
        return 0
    print(f"{'expert format':>14} {'bytes/expert':>13} {'tokens':>8} {'perplexity':>11} {'change':>8}")
    for r in rows:
        print(f"{r['expert_format']:>14} {r['bytes_per_expert']:>13,} {r['tokens']:>8} {r['perplexity']:>11.4f} "
              f"{100 * r['change_vs_first']:>+7.2f}%")
    return 0
