"""Held-out NLL / perplexity under the MoE-Spec verification budget (`verify_expert_budget=K`, lossy).

    .venv/bin/python benchmarks/budget_nll.py [--model DIR] [--budgets 16,8,4,2] [--batches 1,4,32] [--chunk 5]
        [--prefix 16] [--length 64] [--out benchmarks/results/budget_nll.json]

Teacher-forced scoring shaped like verification, per batch size B: B held-out texts (benchmarks/prompts/*.jsonl, domains
interleaved, truncated to --length tokens) are prefilled exactly for --prefix tokens, then advanced
--chunk tokens at a time (γ+1 = 5: a verification forward of B × 5 positions), each chunk's forward
routed through the budget. NLL counts every next token predicted by a chunk forward; "exact" is the
same procedure without a budget (equal to plain scoring).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from specmoe import LLM, SamplingParams  # noqa: E402
from specmoe.bench.machine import provenance  # noqa: E402
from specmoe.decoding.strategies.budget import ExpertBudget  # noqa: E402
from specmoe.decoding.runtime.runner import ModelRunner  # noqa: E402
from specmoe.decoding.runtime.sequence import Sequence  # noqa: E402


def heldout(tokenizer, n: int, length: int) -> list[list[int]]:
    per = []
    for f in sorted((REPO / "benchmarks" / "prompts").glob("*.jsonl")):
        texts = [json.loads(line)["prompt"] for line in f.read_text().splitlines() if line.strip()]
        per.append([ids[:length] for ids in (tokenizer.encode(t) for t in texts) if len(ids) >= length])
    out, i = [], 0
    while len(out) < n and any(i < len(p) for p in per):
        out += [p[i] for p in per if i < len(p)]
        i += 1
    return out[:n]


@torch.inference_mode()
def chunked_nll(llm: LLM, ids: list[list[int]], *, prefix: int, chunk: int, hook) -> tuple[float, int]:
    B, L = len(ids), len(ids[0])
    runner = llm.runner(B, L)
    seqs = [Sequence(seq_id=i, prompt_ids=t, params=SamplingParams(), slot=i, generator=torch.Generator())
            for i, t in enumerate(ids)]
    runner.forward(seqs, [t[:prefix] for t in ids])
    for s in seqs:
        runner.commit(s, prefix)
    tok = torch.tensor(ids)
    nll, count, pos = 0.0, 0, prefix
    while pos < L - 1:
        c = min(chunk, L - 1 - pos)
        logits = runner.forward(seqs, [t[pos:pos + c] for t in ids], ctx=runner.context(routing_hook=hook),
                                all_logits=True)  # [B, c, V]: predicts tokens pos+1 .. pos+c
        lp = torch.log_softmax(logits.float(), -1)
        nll -= lp.gather(-1, tok[:, pos + 1:pos + c + 1, None]).sum().item()
        count += B * c
        for s in seqs:
            runner.commit(s, c)
        pos += c
    return nll, count


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--budgets", default="16,8,4,2")
    ap.add_argument("--batches", default="1,4,32", help="texts scored together (a verification batch)")
    ap.add_argument("--chunk", type=int, default=5)
    ap.add_argument("--prefix", type=int, default=16)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results/budget_nll.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    llm = LLM(args.model, dtype="float32", threads=1) if args.model else LLM(dtype="float32", threads=1)
    rows = []
    for B in [int(x) for x in args.batches.split(",")]:
        ids = heldout(llm.tokenizer, B, args.length)
        group = []
        for k in [None] + [int(x) for x in args.budgets.split(",") if x]:
            hook = ExpertBudget(llm.config, k) if k is not None else None
            nll, n = chunked_nll(llm, ids, prefix=args.prefix, chunk=args.chunk, hook=hook)
            row = {"batch": len(ids), "verify_expert_budget": k, "tokens": n, "nll": nll / n,
                   "perplexity": math.exp(nll / n)}
            if hook is not None:
                row.update(hook.stats())
            group.append(row)
            print(json.dumps(row))
        for r in group:
            r["perplexity_ratio_vs_exact"] = r["perplexity"] / group[0]["perplexity"]
        rows += group
    res = {"command": "python " + " ".join(sys.argv), "provenance": provenance(), "model": str(llm.path),
           "chunk": args.chunk, "prefix": args.prefix, "length": args.length,
           "num_experts": llm.config.num_experts, "top_k": llm.config.top_k, "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
