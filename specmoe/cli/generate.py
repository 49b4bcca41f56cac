"""`specmoe generate`: complete prompts and print the text (or JSON with stats)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

from specmoe.errors import InputError
from specmoe.cli.common import (add_model_args, add_option_args, add_sampling_args, jsonl_prompt, make_llm, print_json,
                                read_text, sampling_kwargs)


def register(sub) -> None:
    p = sub.add_parser("generate", help="generate completions for prompts")
    add_model_args(p)
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for a batch)")
    add_generation_args(p)
    p.set_defaults(func=run)
    t = sub.add_parser("translate", help="translate texts with an encoder-decoder model (NLLB-MoE)",
                       description="Translate each TEXT (and the --prompts-file lines) into --target-lang; "
                                   "language codes as the model's tokenizer names them (NLLB: fra_Latn, deu_Latn, ...).")
    add_model_args(t)
    t.add_argument("prompt", nargs="*", metavar="TEXT", help="a text to translate (several: a batch)")
    add_generation_args(t, translate=True)
    t.set_defaults(func=run)


def add_generation_args(p, translate: bool = False) -> None:
    """The flags `generate` and `translate` share (the sampling parameters, the languages, the options)."""
    p.add_argument("--prompts-file", help="file with one prompt per line, or JSONL with a 'prompt' field")
    p.add_argument("--target-lang", default=None,
                   help="encoder-decoder (translation) models: the language to translate into, e.g. fra_Latn "
                        "(a JSONL row's own 'target_lang' wins)")
    p.add_argument("--source-lang", default=None,
                   help="encoder-decoder (translation) models: the source texts' language (default: eng_Latn; a "
                        "JSONL row's own 'source_lang' wins)")
    add_sampling_args(p, per="prompt")
    p.add_argument("--json", action="store_true", help="print outputs and stats as JSON")
    add_option_args(p)


def read_prompts(args) -> list[str | list[int]]:
    """--prompt texts, then the file's prompts: one per line, or one JSON object per line (.jsonl)
    whose 'prompt' is a string or a list of token ids. Always a batch: one item per prompt."""
    return [p for p, _ in read_requests(args)]


def read_requests(args) -> list[tuple[str | list[int], dict]]:
    """`read_prompts` with each prompt's languages: {"target_lang", "source_lang"} from --target-lang /
    --source-lang, a JSONL row's own fields winning (benchmarks/prompts/translation/*.jsonl)."""
    langs = {"target_lang": args.target_lang, "source_lang": args.source_lang}
    out: list[tuple[str | list[int], dict]] = [(p, langs) for p in args.prompt]
    if args.prompts_file:
        path = Path(args.prompts_file)
        for i, line in enumerate(read_text(path).splitlines()):
            if not line.strip():
                continue
            if path.suffix == ".jsonl":
                p = jsonl_prompt(line, f"{path}:{i + 1}", ids_ok=True)
                row = json.loads(line)
                out.append((p, {k: row[k] if isinstance(row.get(k), str) else v for k, v in langs.items()}))
            else:
                out.append((line, langs))
    prompts = out
    if not prompts and args.command == "translate":
        raise InputError("nothing to translate: give a TEXT or --prompts-file")
    if not prompts:
        prompts = [("def fibonacci(n):", langs)]
    return prompts


def run(args) -> int:
    from specmoe import SamplingParams
    reqs = read_requests(args)
    prompts = [p for p, _ in reqs]
    langs = {k: [lang[k] for _, lang in reqs] for k in ("target_lang", "source_lang")}
    langs = {k: None if all(v is None for v in vs) else vs for k, vs in langs.items()}  # None: not given at all
    params = SamplingParams(**sampling_kwargs(args))
    llm = make_llm(args, progress=not args.json)
    outs = llm.generate(prompts, params, use_tqdm=len(prompts) > 1 and not args.json, **langs)
    seq2seq = llm.config.seq2seq is not None  # the text is a translation, not a continuation of the prompt
    if args.json:
        print_json({"model": str(llm.path), "outputs": [
            {"prompt": o.prompt, "text": o.text, "token_ids": o.token_ids, "finish_reason": o.finish_reason}
            for o in outs], "stats": llm.stats})
        return 0
    for o in outs:
        shown = o.prompt if o.prompt is not None else o.prompt_token_ids
        sys.stdout.write(f"--- prompt: {shown!r}\n{'' if seq2seq else o.prompt or ''}{o.text}\n")
    sys.stderr.write(summary(llm.stats) + "\n")
    return 0


def summary(s: dict) -> str:
    parts = [f"{s['generated_tokens']} tokens", f"{s['decode_tokens_per_s']:.1f} tok/s decode",
             f"prefill {s['prefill_time_s'] * 1e3:.0f} ms"]
    if s.get("offload", "none") != "none":
        parts.append(f"experts on {s['offload']}{' (emulated link)' if s.get('emulated_link') else ''}: "
                     f"{s['bytes_moved'] / 2**20:.1f} MiB moved, {s.get('bytes_per_token', 0) / 2**10:.0f} KiB/token, "
                     f"hit rate {s['hit_rate']:.2f}")
    if s.get("decoding") in ("specmoe", "auto"):
        parts.append(f"tokens/step {s['tokens_per_step']:.2f}")
    return "[" + ", ".join(parts) + "]"

