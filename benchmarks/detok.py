"""Detokenization cost per output token, and streamed text against the final text.

    python benchmarks/detok.py [--repeats 15] [--max-tokens 32] [--skip-stream]

1. Cost. The demo tokenizer, the bundled prompts' tokens as an output stream, a never-matching stop string.
   For 100 and 1,000 output tokens: the mean time per token of the engine's incremental `Detokenizer`
   (push + the visible piece, what `EngineCore._append` does per token) and of the rule it replaced (decode
   the whole output, look for the stop string in it): the fastest of `--repeats` runs (and the median), and
   the mean over a run's last 100 tokens. Target: incremental per-token time at 1,000 within 1.5× of that at
   100.
2. Streaming. Every prompt in benchmarks/prompts/ through one engine session on the demo model (seeded
   sampling, `--max-tokens`, stop strings that end many of them): the pieces of each request's updates
   joined must equal its final text, and the final text and the token where it stops must equal what full
   decoding gives (the full decode after each token, cut before the first stop string).

Writes benchmarks/results/detok.json with the commit it ran on.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from specmoe import LLM, SamplingParams  # noqa: E402
from specmoe.bundled import prompts_dir  # noqa: E402
from specmoe.engine.core import Request  # noqa: E402
from specmoe.engine.detokenizer import Detokenizer  # noqa: E402

NEVER = "\x00never matches\x00"
STOPS = ["\n\n", "):", "LORD,"]  # end many of the demo model's continuations of the bundled prompts


def prompts() -> list[str]:
    return [json.loads(line)["prompt"] for f in sorted(prompts_dir().glob("*.jsonl"))
            for line in f.read_text().splitlines() if line.strip()]


def incremental(tok, ids: list[int], mark: int) -> float:
    """Push every token and take its visible piece, as the engine does; the time at token `mark`."""
    d = Detokenizer(tok, [NEVER])
    at = 0.0
    for k, t in enumerate(ids):
        if k == mark:
            at = time.perf_counter()
        d.push(t)
        d.take(finished=False)
    return at


def full_decode(tok, ids: list[int], mark: int) -> float:
    """The rule the engine had: after every token, decode the whole output and look for the stop strings."""
    at = 0.0
    for k in range(len(ids)):
        if k == mark:
            at = time.perf_counter()
        _ = NEVER in tok.decode(ids[:k + 1])
    return at


def timed(fn, tok, ids: list[int], repeats: int) -> dict:
    """Mean µs per token over the whole run and over its last 100 tokens: the fastest of `repeats` runs (the
    machine is shared; a slower run is one another process interrupted) and the median."""
    whole, last = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        at = fn(tok, ids, len(ids) - 100)
        t1 = time.perf_counter()
        whole.append((t1 - t0) / len(ids) * 1e6)
        last.append((t1 - at) / 100 * 1e6)
    return {"us_per_token": min(whole), "median_us_per_token": statistics.median(whole),
            "last_100_us_per_token": min(last)}


def cost(tok, repeats: int) -> dict:
    stream = [t for p in prompts() for t in tok.encode(p)][:1000]
    out = {"stream": "the bundled prompts' tokens, concatenated", "stop": NEVER, "repeats": repeats}
    for name, fn in (("incremental", incremental), ("full_decode", full_decode)):
        row = {str(n): timed(fn, tok, stream[:n], repeats) for n in (100, 1000)}
        row["ratio_1000_vs_100"] = row["1000"]["us_per_token"] / row["100"]["us_per_token"]
        out[name] = row
    out["target"] = "incremental ratio_1000_vs_100 <= 1.5"
    out["met"] = out["incremental"]["ratio_1000_vs_100"] <= 1.5
    return out


def reference(tok, ids: list[int], stops: list[str]) -> tuple[int, str]:
    """(tokens kept, final text) as full decoding gives them: the first token whose text completes a stop
    string ends the output, the text is cut before the first stop string."""
    for k in range(len(ids)):
        full = tok.decode(ids[:k + 1])
        hits = [full.index(s) for s in stops if s in full]
        if hits:
            return k + 1, full[:min(hits)]
    return len(ids), tok.decode(ids)


def streaming(llm: LLM, max_tokens: int) -> dict:
    texts = prompts()
    ids = [llm.tokenizer.encode(t) for t in texts]
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.9, seed=i, stop=STOPS) for i in range(len(ids))]
    pieces: dict[int, list[str]] = {}
    t0 = time.perf_counter()
    with llm.engine(list(zip(ids, params))) as core:
        reqs = [core.add(Request(prompt_ids=p, params=sp, prompt=t)) for p, t, sp in zip(ids, texts, params)]
        while core.has_work:
            for u in core.step():
                pieces.setdefault(u.request.request_id, []).append(u.text)
    wall = time.perf_counter() - t0
    bad_stream, bad_final, stopped = [], [], 0
    for r in reqs:
        if "".join(pieces[r.request_id]) != r.text:
            bad_stream.append(r.request_id)
        stops = STOPS if r.finish_reason == "stop" else []
        want_len, want_text = reference(llm.tokenizer, r.output_ids, stops)
        if (want_len, want_text) != (len(r.output_ids), r.text):
            bad_final.append(r.request_id)
        stopped += r.finish_reason == "stop"
    return {"prompts": len(reqs), "max_tokens": max_tokens, "stops": STOPS, "stopped_by_stop_or_eos": stopped,
            "generated_tokens": sum(len(r.output_ids) for r in reqs), "wall_s": wall,
            "stream_differs_from_final": bad_stream, "final_differs_from_full_decoding": bad_final,
            "met": not bad_stream and not bad_final}


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--skip-stream", action="store_true", help="only the cost part")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "detok.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    llm = LLM(dtype="float32", threads=1)
    res = {"commit": git("rev-parse", "HEAD"),
           "uncommitted_changes_in_specmoe": bool(git("status", "--porcelain", "specmoe")),
           "cost_per_token_us": cost(llm.tokenizer, args.repeats)}
    print(json.dumps(res["cost_per_token_us"], indent=1))
    if not args.skip_stream:
        res["streaming"] = streaming(llm, args.max_tokens)
        print(json.dumps({k: v for k, v in res["streaming"].items()}, indent=1))
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0 if res["cost_per_token_us"]["met"] and res.get("streaming", {"met": True})["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
