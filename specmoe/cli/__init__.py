"""`specmoe` command line: thin parsers over library calls. Each subcommand lives in its
own module with `register(subparsers)`; user errors print one line and exit 2."""
from __future__ import annotations

import argparse
import signal
import sys
import threading

from specmoe.errors import SpecMoEError

SUBCOMMANDS = ("generate", "inspect", "profile", "bench", "serve", "plan", "batch", "quantize", "perplexity")


def build_parser() -> argparse.ArgumentParser:
    import importlib
    from specmoe.cli.common import OneLineParser
    p = OneLineParser(prog="specmoe", description="Offloaded MoE inference with expert-aware "
                                "speculative decoding. Every command defaults to the bundled demo model.")
    sub = p.add_subparsers(dest="command", required=True)
    for name in SUBCOMMANDS:
        try:
            mod = importlib.import_module(f"specmoe.cli.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"specmoe.cli.{name}":
                raise
            continue
        mod.register(sub)
    return p


_interrupted = threading.Event()


def _on_sigint(signum, frame):
    _interrupted.set()
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _interrupted.clear()  # (an earlier call in this process may have been interrupted)
    previous = None
    if threading.current_thread() is threading.main_thread():
        # remembered: an interrupt raised inside a native call can come back as another exception (safetensors'
        # slice read turned it into "ValueError: could not determine the shape of ... UntypedStorage")
        previous = signal.signal(signal.SIGINT, _on_sigint)
    try:
        return args.func(args) or 0
    except KeyboardInterrupt:
        return _interrupted_exit()
    except Exception as e:
        if _interrupted.is_set():  # whatever a native call made of the interrupt
            return _interrupted_exit()
        if not isinstance(e, SpecMoEError):
            raise
        print(f"specmoe: error: {e}", file=sys.stderr)
        return 2
    finally:
        if previous is not None:  # an in-process caller gets its own handler back
            signal.signal(signal.SIGINT, previous)


def _interrupted_exit() -> int:
    print("specmoe: interrupted", file=sys.stderr)
    return 130
