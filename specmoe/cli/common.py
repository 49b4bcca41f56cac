"""Flags shared by subcommands, generated from the option dataclasses."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import MISSING, fields
from pathlib import Path

from specmoe.errors import InputError
from specmoe.options import OffloadConfig, SpecConfig


class OneLineParser(argparse.ArgumentParser):
    """Usage errors as one line on stderr and exit 2, like every other user error."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def read_text(path: Path, what: str = "prompts file") -> str:
    """A UTF-8 text file, every failure an InputError naming it."""
    if not path.is_file():
        raise InputError(f"{what} not found: {path}")
    try:
        return path.read_bytes().decode("utf-8")
    except OSError as e:
        raise InputError(f"cannot read {what} {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise InputError(f"{what} {path} is not UTF-8 text (invalid byte at offset {e.start})") from None


def jsonl_prompt(line: str, where: str, *, ids_ok: bool):
    """The 'prompt' of one JSONL row: a string, or (ids_ok) a non-empty list of token ids. A bare
    number is refused, so rows of integers never merge into one token-id prompt."""
    want = "a JSON object whose 'prompt' is a string" + (" or a list of token ids" if ids_ok else "")
    try:
        row = json.loads(line)
    except (json.JSONDecodeError, RecursionError):
        raise InputError(f"{where}: expected {want}; the line is not valid JSON") from None
    p = row.get("prompt") if isinstance(row, dict) else None
    if isinstance(p, str):
        return p
    if ids_ok and isinstance(p, list) and p and all(type(t) is int for t in p):
        return p
    got = "no 'prompt' field" if not isinstance(row, dict) or "prompt" not in row else f"'prompt' is {p!r}"[:80]
    raise InputError(f"{where}: expected {want}; got {got}")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory (default: the bundled demo model)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="compute dtype (auto = the checkpoint's)")
    p.add_argument("--device", default="cpu", help="compute device: cpu or cuda")
    p.add_argument("--max-batch", type=int, default=256, help="KV-cache slots (max concurrent sequences)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for compute (default: torch's)")


def add_sampling_args(p, per: str = "request") -> None:
    """The sampling flags (`SamplingParams`' fields), defined once for every command that generates; `per` names
    what one parameter set applies to (a request, a row). `sampling_kwargs(args)` reads them back."""
    p.add_argument("--max-tokens", type=int, default=64, help=f"tokens to generate per {per}")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens (0 = off)")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    p.add_argument("--seed", type=int, default=None, help=f"seed for sampling (per {per})")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")


def sampling_kwargs(args) -> dict:
    """`SamplingParams` keyword arguments from the flags `add_sampling_args` defined."""
    return dict(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                seed=args.seed, stop=args.stop)


def add_option_args(p: argparse.ArgumentParser) -> None:
    """One flag per field of OffloadConfig and SpecConfig (--cache-policy, --draft-experts, ...)."""
    for cls in (OffloadConfig, SpecConfig):
        g = p.add_argument_group(cls.__name__, cls.__doc__)
        for f in fields(cls):
            default = f.default if f.default is not MISSING else None
            kw = {"help": f"{f.metadata.get('help', '')} (default: {default})", "default": default}
            if f.metadata.get("choices"):
                kw["choices"] = f.metadata["choices"]
            typ = f.metadata.get("type") or (type(default) if default is not None else str)
            if typ is bool:
                kw["action"] = argparse.BooleanOptionalAction
            else:
                kw["type"] = typ
            flag = "--" + f.name.replace("_", "-")
            if flag in p._option_string_actions:  # e.g. SpecConfig.seed vs generate's --seed
                flag = f"--{PREFIX[cls]}-{f.name.replace('_', '-')}"
            g.add_argument(flag, dest="opt__" + f.name, metavar=f.name.upper() if "choices" not in kw else None,
                           **kw)


PREFIX = {OffloadConfig: "offload", SpecConfig: "spec"}


def option_kwargs(args) -> dict:
    return {f.name: getattr(args, "opt__" + f.name) for cls in (OffloadConfig, SpecConfig) for f in fields(cls)
            if hasattr(args, "opt__" + f.name)}


def llm_kwargs(args) -> dict:
    """LLM(...) keywords from add_model_args + add_option_args flags."""
    if getattr(args, "opt__prefetch", None) == "oracle":  # it needs a recorded identical run to replay
        raise InputError("--prefetch oracle replays a recorded identical run and is measured by `specmoe bench` "
                         "(system 'overlap') only; use --prefetch predicted")
    return dict(model=args.model, dtype=args.dtype, device=args.device, max_batch=args.max_batch,
                threads=args.threads, **option_kwargs(args))


def make_llm(args, progress: bool = True, **kw):
    from specmoe import LLM
    return LLM(progress=progress, **kw, **llm_kwargs(args))


def print_json(obj) -> None:
    json.dump(obj, sys.stdout, indent=2, default=str)
    sys.stdout.write("\n")
