"""SpecMoE decode tok/s on the widened demo model (disk tier), this tree vs another checkout, back to back.

    python benchmarks/core_speed.py --old /tmp/oldmain [--batches 4 16] [--max-tokens 24] [--dtype float32] [--rounds 2]

Each measurement runs in a fresh subprocess with PYTHONPATH set to the tree under test: one short warm-up
generate, then a measured generate; decode tok/s = generated tokens / decode seconds (engine stats). The
trees alternate (old, new, `--rounds` times per batch size) so both see the same machine load; the median
run of each tree is reported. Also reports, at the largest
batch, this tree's draft forward time (step_breakdown draft parts / draft forwards) against a resident
decode step (resident AR run: decode seconds / decode steps), and checks this tree's step breakdown at every
batch: the timed parts must cover the decode wall time within 5% (`other_s`, what no phase timed, <= 5%), and
"draft-set refresh + bookkeeping" (refresh, first draft-set setup, accept/sample, scheduling and the untimed
rest: everything that is neither a forward nor a fetch wait) as a share of decode wall time (target <= 3%).
Writes benchmarks/results/core_speed.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
OUT = HERE / "results" / "core_speed.json"

RUN = r"""
import json, sys, torch
from specmoe import LLM, SamplingParams
from specmoe.bench.widen import widened_copy
from specmoe.engine.llm import default_model_path
torch.set_num_threads(int(sys.argv[4]))
path, _ = widened_copy(default_model_path(), cache_dir="/tmp/wide", expert_mb=6.0, progress=False)
kw = json.loads(sys.argv[1]); B = int(sys.argv[2]); n = int(sys.argv[3])
llm = LLM(path, **kw)
prompts = [[(13 * i + 7 * j) % 8000 + 1 for j in range(24)] for i in range(B)]
llm.generate(prompts[:B], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up (first-use costs)
llm.reset_stats()
s0 = dict(llm.stats)
out = llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True))
s = llm.stats
keys = ("generated_tokens", "decode_time_s", "decode_steps")
d = {k: s[k] - s0.get(k, 0) for k in keys}
bd0, bd = s0.get("step_breakdown", {}), s.get("step_breakdown", {})
d["step_breakdown"] = {k: v - bd0.get(k, 0) for k, v in bd.items() if isinstance(v, (int, float))}
for k in ("tokens_per_step", "draft_forwards", "hit_rate", "steps"):
    if k in s:
        d[k] = s[k]
d["decode_tokens_per_s"] = d["generated_tokens"] / d["decode_time_s"]
d["tokens"] = [o.token_ids for o in out]
print("RESULT" + json.dumps(d))
"""


def run(tree: Path, kw: dict, batch: int, max_tokens: int, threads: int) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    p = subprocess.run([sys.executable, "-c", RUN, json.dumps(kw), str(batch), str(max_tokens), str(threads)],
                       cwd=tree, env=env, capture_output=True, text=True, timeout=3000)
    for line in p.stdout.splitlines():
        if line.startswith("RESULT"):
            return json.loads(line[6:])
    raise RuntimeError(f"{tree}: {p.stderr[-3000:]}")


def median_run(runs: list[dict]) -> dict:
    """The run with the median decode tok/s (the lower middle one for an even count)."""
    return sorted(runs, key=lambda r: r["decode_tokens_per_s"])[(len(runs) - 1) // 2]


BOOKKEEPING = ("draft_refresh_s", "draft_setup_s", "accept_sample_s", "scheduling_s", "other_s")


def breakdown_check(bd: dict) -> dict:
    """Untimed share (the parts must add up within 5%) and the refresh + bookkeeping share of decode wall time."""
    wall = bd["decode_wall_s"]
    timed = sum(v for k, v in bd.items() if k not in ("decode_wall_s", "other_s"))
    return {"timed_parts_over_wall": timed / wall, "untimed_share": bd["other_s"] / wall,
            "parts_add_up_within_5pct": abs(timed - wall) <= 0.05 * wall,
            "draft_refresh_share": bd["draft_refresh_s"] / wall,
            "refresh_plus_bookkeeping_share": sum(bd[k] for k in BOOKKEEPING) / wall}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="the other checkout (e.g. a worktree of main)")
    ap.add_argument("--new", default=str(HERE.parent), help="the checkout under test (default: this one)")
    ap.add_argument("--batches", type=int, nargs="+", default=[4, 16])
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="old/new pairs per batch (the median run is reported)")
    ap.add_argument("--out", default=str(OUT))
    a = ap.parse_args(argv)
    new, old = Path(a.new).resolve(), Path(a.old).resolve()
    spec = {"dtype": a.dtype, "offload": "disk", "decoding": "specmoe"}
    sys.path.insert(0, str(new))
    from specmoe.bench.machine import provenance
    old_commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=old, capture_output=True, text=True).stdout.strip()
    res = {"command": "python " + " ".join(sys.argv), "provenance": provenance(), "old_commit": old_commit or None,
           "options": spec, "max_tokens": a.max_tokens, "threads": a.threads, "batches": {}}
    for B in a.batches:
        olds, news = [], []
        for _ in range(a.rounds):  # alternating, so both trees see the same machine load
            olds.append(run(old, spec, B, a.max_tokens, a.threads))
            news.append(run(new, spec, B, a.max_tokens, a.threads))
        same = all(r.pop("tokens") == n.pop("tokens") for r, n in zip(olds, news))
        r_old, r_new = median_run(olds), median_run(news)
        res["batches"][B] = {"old": r_old, "new": r_new, "same_tokens": same,
                             "old_tok_s_rounds": [r["decode_tokens_per_s"] for r in olds],
                             "new_tok_s_rounds": [r["decode_tokens_per_s"] for r in news],
                             "speedup": r_new["decode_tokens_per_s"] / r_old["decode_tokens_per_s"],
                             "breakdown_check": breakdown_check(r_new["step_breakdown"])}
        print(f"batch {B}: old {r_old['decode_tokens_per_s']:.2f} tok/s, new {r_new['decode_tokens_per_s']:.2f} "
              f"tok/s -> {res['batches'][B]['speedup']:.2f}x (same tokens: {same}); new breakdown: "
              f"{res['batches'][B]['breakdown_check']}", flush=True)
    B = max(a.batches)
    resident = run(new, {"dtype": a.dtype, "offload": "none", "decoding": "ar"}, B, a.max_tokens, a.threads)
    resident.pop("tokens")
    spec_new = res["batches"][B]["new"]
    bd = spec_new["step_breakdown"]
    draft_s = bd.get("draft_nonexpert_s", 0) + bd.get("draft_experts_s", 0)
    draft_fwd = draft_s / max(1, spec_new.get("draft_forwards", 0))
    res_step = resident["decode_time_s"] / resident["decode_steps"]
    res["draft_vs_resident_step"] = {"batch": B, "draft_forward_s": draft_fwd, "resident_step_s": res_step,
                                     "ratio": draft_fwd / res_step, "resident": resident}
    print(f"batch {B}: draft forward {draft_fwd * 1e3:.1f} ms vs resident decode step {res_step * 1e3:.1f} ms "
          f"-> {draft_fwd / res_step:.2f}x")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    main()
