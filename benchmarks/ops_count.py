"""Ops dispatched and host syncs per decode step (AR and SpecMoE), resident experts, fp32.

    python benchmarks/ops_count.py [--model PATH] [--batch 1] [--gamma 4] [--steps 6]

Counts every aten op dispatched inside the decode steps of a real `generate` call (the engine's strategy
step, wrapped) with `specmoe.bench.opcount.OpCounter`, after two warm-up steps, and divides by the
model's layers ("ops per layer"). Host syncs: `.item()` / `.tolist()` / `nonzero` / device->CPU copies.
Writes benchmarks/results/ops_count.json.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

import specmoe.engine.llm as llm_mod
from specmoe import LLM, SamplingParams
from specmoe.bench.machine import provenance
from specmoe.bench.opcount import OpCounter
from specmoe.engine.llm import default_model_path

OUT = Path(__file__).parent / "results" / "ops_count.json"


def measure(path, decoding: str, *, batch: int, gamma: int, steps: int, warmup: int = 2) -> dict:
    records = []
    make = llm_mod.make_strategy

    def counted_strategy(*a, **kw):
        strategy = make(*a, **kw)
        step = strategy.step

        def counted(active):
            if len(records) >= warmup + steps:
                return step(active)
            with OpCounter() as c:
                out = step(active)
            records.append({"ops": c.ops, "syncs": c.syncs, "sync_sites": dict(c.sync_sites),
                            "tokens": sum(len(t) for t in out.tokens.values()), "by_op": dict(c.by_op)})
            return out
        strategy.step = counted
        return strategy
    llm_mod.make_strategy = counted_strategy
    try:
        llm = LLM(path, dtype="float32", decoding=decoding, num_draft_tokens=gamma)
        prompts = [[(7 * i + j) % 500 + 1 for j in range(12)] for i in range(batch)]
        llm.generate(prompts, SamplingParams(max_tokens=2 * (warmup + steps) * (gamma + 1), ignore_eos=True))
    finally:
        llm_mod.make_strategy = make
    got = records[warmup:warmup + steps]
    assert len(got) == steps, f"only {len(records)} steps ran"
    L = llm.config.num_layers
    ops = sum(r["ops"] for r in got) / len(got)
    by_op: dict = {}
    for r in got:
        for k, v in r["by_op"].items():
            by_op[k] = by_op.get(k, 0) + v / len(got)
    sites: dict = {}
    for r in got:
        for k, v in r["sync_sites"].items():
            sites[k] = sites.get(k, 0) + v / len(got)
    return {"decoding": decoding, "batch": batch, "layers": L, "moe_layers": len(llm.config.moe_layers),
            "steps_measured": len(got), "ops_per_step": ops, "ops_per_layer": ops / L,
            "host_syncs_per_step": sum(r["syncs"] for r in got) / len(got), "sync_sites": sites,
            "tokens_per_step": sum(r["tokens"] for r in got) / len(got) / batch,
            "top_ops": dict(sorted(by_op.items(), key=lambda kv: -kv[1])[:25])}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the bundled demo model)")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    path = a.model or default_model_path()
    ar = measure(path, "ar", batch=a.batch, gamma=a.gamma, steps=a.steps)
    spec = measure(path, "specmoe", batch=a.batch, gamma=a.gamma, steps=a.steps)
    res = {"command": "python benchmarks/ops_count.py " + " ".join(sys.argv[1:]), "provenance": provenance(),
           "model": str(path),
           "machine": platform.machine(), "torch": torch.__version__, "ar": ar, "specmoe": spec,
           "specmoe_over_ar_ops_per_layer": spec["ops_per_layer"] / ar["ops_per_layer"]}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    for r in (ar, spec):
        print(f"{r['decoding']:8s} batch {r['batch']}: {r['ops_per_step']:.0f} ops/step, "
              f"{r['ops_per_layer']:.1f} ops per layer ({r['layers']} layers), {r['host_syncs_per_step']:.1f} host syncs/step {r['sync_sites']}, "
              f"tau {r['tokens_per_step']:.2f}")
    print(f"SpecMoE step / AR step, ops per layer: {res['specmoe_over_ar_ops_per_layer']:.2f}x -> {out}")
    return res


if __name__ == "__main__":
    main()
