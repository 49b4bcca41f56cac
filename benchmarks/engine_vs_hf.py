"""Decode throughput of specmoe's runtime vs transformers `generate`, same model, same prompts,
batch 1 and 16, greedy, all weights resident. Not a test: speed is measured as a ratio in one run.

    .venv/bin/python benchmarks/engine_vs_hf.py [--model DIR] [--dtype float32|bfloat16] [--tokens 64]
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time

import torch


def tiny_model(path):
    from tests.conftest import make_tiny_checkpoint
    return make_tiny_checkpoint("qwen3_moe", path, hidden_size=256, num_hidden_layers=6,
                                moe_intermediate_size=128, num_experts=32, vocab_size=8192, head_dim=64)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None, help="checkpoint dir (default: a tiny random Qwen3-MoE)")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--out", default=None)
    ap.add_argument("--threads", type=int, default=None, help="torch threads for both engines")
    ap.add_argument("--hf-experts", default="eager", help="transformers experts_implementation (eager|grouped_mm)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    from specmoe import LLM, SamplingParams
    path = args.model or tiny_model(tempfile.mkdtemp())
    dt = getattr(torch, args.dtype)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dt, experts_implementation=args.hf_experts).eval()
    llm = LLM(path, dtype=args.dtype)
    rows = []
    g = torch.Generator().manual_seed(0)
    for B in [int(b) for b in args.batches.split(",")]:
        prompts = torch.randint(10, llm.config.vocab_size, (B, 32), generator=g)
        params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)
        llm.generate(prompts[:, :8].tolist(), SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
        llm.reset_stats()
        t0 = time.perf_counter()
        outs = llm.generate(prompts.tolist(), params)
        ours_wall = time.perf_counter() - t0
        s = llm.stats
        with torch.no_grad():
            hf.generate(prompts[:, :8], max_new_tokens=4, min_new_tokens=4, do_sample=False)
            t0 = time.perf_counter()
            ref = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=args.tokens,
                              min_new_tokens=args.tokens, do_sample=False)
            hf_wall = time.perf_counter() - t0
        same = sum(o.token_ids == r[32:].tolist() for o, r in zip(outs, ref))
        rows.append({"batch": B, "specmoe_tok_s": B * args.tokens / ours_wall,
                     "specmoe_decode_tok_s": s["decode_tokens_per_s"], "hf_tok_s": B * args.tokens / hf_wall,
                     "speedup": hf_wall / ours_wall, "identical_sequences": f"{same}/{B}"})
    print(f"model: {path}  dtype: {args.dtype}  HF experts: {args.hf_experts}  new tokens: {args.tokens}  threads: {torch.get_num_threads()}  "
          "(tok/s end-to-end incl. prefill)")
    print(f"{'batch':>5} {'specmoe tok/s':>14} {'(decode only)':>14} {'HF tok/s':>10} {'ratio':>7} {'identical':>10}")
    for r in rows:
        print(f"{r['batch']:>5} {r['specmoe_tok_s']:>14.1f} {r['specmoe_decode_tok_s']:>14.1f} "
              f"{r['hf_tok_s']:>10.1f} {r['speedup']:>6.2f}x {r['identical_sequences']:>10}")
    if args.out:
        from specmoe.bench.machine import provenance
        json.dump({"command": "python benchmarks/engine_vs_hf.py " + " ".join(sys.argv[1:]), "provenance": provenance(),
                   "model": str(path), "dtype": args.dtype, "rows": rows}, open(args.out, "w"), indent=2)


if __name__ == "__main__":
    main()
