"""Determinism (issue 25 part 1): do identical requests give identical tokens whatever runs beside or before them?

    python benchmarks/determinism_bench.py [--baseline DIR] [--rounds 5] [--sections generate,server,attention,cost]

Four sections, on the demo model, one torch thread (`--threads`), dtypes bfloat16, float32 and float32 with
`deterministic=True` (the machine's default dtype, `dtype="auto"`, is recorded):

- generate (LLM.generate), for ar, specmoe with each drafter (self, ngram, eagle) and auto:
  greedy: 16 code prompts, each alone vs all in one batch of 16 → rows equal (of 16);
  seeded: `def fibonacci(n):` at T 0.8 with seeds 0..15, each alone vs all in one batch → rows equal (of 16);
  repeated: 20 greedy `def fibonacci(n):` requests, the even ones alone after an unrelated request (draft-set and
  controller state move), the odd ones inside a batch of 1-15 random neighbours at a random place → distinct texts.
- server (a real `specmoe.serve` app under uvicorn on a loopback port, POST /v1/completions), ar / specmoe / auto:
  20 sequential then 8 concurrent identical greedy `def fibonacci(n):` requests → distinct texts (target 1); 16
  seeds at T 0.8 sequentially and then all 16 concurrently → seeds whose tokens match (target 16).
- attention: the fixed-split attention's own cost, in one process (no cross-process noise): the same bf16 LLM
  generates with it and with PyTorch's SDPA in alternate rounds; tokens per CPU second, ratio of medians.
- cost: decode tok/s of this tree against `--baseline` (a checkout of the commit before the fix, e.g. `git archive
  e645ca9 | tar -x -C /tmp/base`), in fresh subprocesses, the trees alternating within each of `--rounds` rounds;
  the ratio of the median tok/s (this / baseline) per configuration. The baseline has no `deterministic` option:
  float32+deterministic is compared with the baseline's plain float32.

Writes benchmarks/results/determinism.json (with this tree's commit).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
OUT = HERE / "results" / "determinism.json"
FIB = "def fibonacci(n):"
DTYPES = {"bfloat16": {"dtype": "bfloat16"}, "float32": {"dtype": "float32"},
          "float32+deterministic": {"dtype": "float32", "deterministic": True}}
CONFIGS = {"ar": {"decoding": "ar"}, "specmoe-self": {"decoding": "specmoe"},
           "specmoe-ngram": {"decoding": "specmoe", "drafter": "ngram"},
           "specmoe-eagle": {"decoding": "specmoe", "drafter": "eagle"}, "auto": {"decoding": "auto"}}


def supported(kw: dict) -> bool:
    """Whether this tree's LLM takes these options (a baseline checkout has no `deterministic`)."""
    from specmoe.options import SpecConfig
    return "deterministic" not in kw or "deterministic" in SpecConfig.__dataclass_fields__


def prompts(n: int, cut: int = 160) -> list[str]:
    lines = (HERE / "prompts" / "code.jsonl").read_text().splitlines()
    return [json.loads(line)["prompt"][:cut] for line in lines[:n]]


# ------------------------------------------------------------------ generate
def generate_section(threads: int, max_tokens: int) -> dict:
    from specmoe import LLM, SamplingParams
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    P, others = prompts(16), prompts(40)[16:]
    out = {}
    for dname, dkw in DTYPES.items():
        for cname, ckw in CONFIGS.items():
            if not supported(dkw):
                continue
            t0 = time.perf_counter()
            llm = LLM(threads=threads, **dkw, **ckw)
            alone = [llm.generate([p], greedy)[0].token_ids for p in P]
            batch = [o.token_ids for o in llm.generate(P, greedy)]
            seeded = [SamplingParams(max_tokens=max_tokens, temperature=0.8, seed=s) for s in range(16)]
            s_alone = [llm.generate([FIB], sp)[0].token_ids for sp in seeded]
            s_batch = [o.token_ids for o in llm.generate([FIB] * 16, seeded)]
            rng, texts = random.Random(0), []
            for i in range(20):
                if i % 2 == 0:
                    llm.generate([rng.choice(others)], greedy)  # something else ran before
                    texts.append(llm.generate([FIB], greedy)[0].text)
                else:
                    nb = rng.sample(others, rng.randint(1, 15))
                    at = rng.randint(0, len(nb))
                    texts.append(llm.generate(nb[:at] + [FIB] + nb[at:], greedy)[at].text)
            out[f"{dname}/{cname}"] = {
                "dtype": dname, "config": cname, "greedy_batch1_eq_batch16": sum(a == b for a, b in zip(alone, batch)),
                "seeded_alone_eq_batch16": sum(a == b for a, b in zip(s_alone, s_batch)),
                "repeated_distinct_texts": len(set(texts)), "of": 16, "repeats": 20,
                "seconds": round(time.perf_counter() - t0, 1)}
            print(json.dumps(out[f"{dname}/{cname}"]), flush=True)
            llm.close()
    return out


# ------------------------------------------------------------------ server
def start_server(llm):
    import uvicorn

    from specmoe.serve.app import build_app
    from specmoe.serve.config import ServeConfig
    from specmoe.serve.http import uvicorn_config
    cfg = ServeConfig(port=0)
    srv = uvicorn.Server(uvicorn_config(build_app(llm, cfg), cfg, log_level="warning", lifespan="on"))
    th = threading.Thread(target=srv.run, daemon=True)
    th.start()
    while not srv.started:
        assert th.is_alive(), "the server did not start"
        time.sleep(0.02)
    return srv, th, f"http://127.0.0.1:{srv.servers[0].sockets[0].getsockname()[1]}"


def server_section(threads: int, max_tokens: int) -> dict:
    import httpx

    from specmoe import LLM
    out = {}
    for dname, dkw in DTYPES.items():
        for cname in ("ar", "specmoe-self", "auto"):
            if not supported(dkw):
                continue
            llm = LLM(threads=threads, **dkw, **CONFIGS[cname])
            srv, th, url = start_server(llm)
            try:
                with httpx.Client(base_url=url, timeout=600) as c:
                    def complete(body: dict) -> str:
                        r = c.post("/v1/completions", json={"prompt": FIB, "max_tokens": max_tokens, **body})
                        r.raise_for_status()
                        return r.json()["choices"][0]["text"]
                    greedy = {"temperature": 0.0}
                    seq = [complete(greedy) for _ in range(20)]
                    with ThreadPoolExecutor(8) as ex:
                        conc = list(ex.map(lambda _: complete(greedy), range(8)))
                    s_seq = [complete({"temperature": 0.8, "seed": s}) for s in range(16)]
                    with ThreadPoolExecutor(16) as ex:
                        s_conc = list(ex.map(lambda s: complete({"temperature": 0.8, "seed": s}), range(16)))
            finally:
                srv.should_exit = True
                th.join(30)
                llm.close()
            out[f"{dname}/{cname}"] = {
                "dtype": dname, "config": cname, "greedy_sequential_distinct": len(set(seq)),
                "greedy_concurrent_distinct": len(set(conc)), "greedy_all_distinct": len(set(seq + conc)),
                "seeded_sequential_eq_concurrent": sum(a == b for a, b in zip(s_seq, s_conc)), "seeds": 16}
            print(json.dumps(out[f"{dname}/{cname}"]), flush=True)
    return out


# ------------------------------------------------------------------ cost
COST = [(d, c, b) for d in DTYPES for c in ("ar", "specmoe-self") for b in (1, 16)]
WORKER = r"""
import json, sys, time, torch
from specmoe import LLM, SamplingParams
from specmoe.options import SpecConfig
runs, threads, n, texts = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
has_det = "deterministic" in SpecConfig.__dataclass_fields__
out, llms = [], {}
for kw, B in runs:
    if not has_det:
        kw = {k: v for k, v in kw.items() if k != "deterministic"}
    key = json.dumps(kw, sort_keys=True)
    if key not in llms:
        llms[key] = LLM(threads=threads, **kw)
    llm = llms[key]
    llm.generate(texts[:B], SamplingParams(max_tokens=4, ignore_eos=True))  # warm-up
    llm.reset_stats()
    c0 = time.process_time()
    llm.generate(texts[:B], SamplingParams(max_tokens=n, ignore_eos=True))
    cpu = time.process_time() - c0
    s = llm.stats
    out.append({"decode_tok_s": s["generated_tokens"] / s["decode_time_s"], "tok_per_cpu_s": s["generated_tokens"] / cpu})
print("RESULT" + json.dumps(out))
"""


def cost_section(baseline: Path, rounds: int, threads: int, max_tokens: int) -> dict:
    runs = [({**DTYPES[d], **CONFIGS[c]}, b) for d, c, b in COST]
    texts = prompts(16)
    got = {"new": [], "baseline": []}
    for r in range(rounds):
        for tree in (("new", "baseline") if r % 2 == 0 else ("baseline", "new")):
            path = ROOT if tree == "new" else baseline
            p = subprocess.run([sys.executable, "-c", WORKER, json.dumps(runs), str(threads), str(max_tokens),
                                json.dumps(texts)], cwd=path, env=dict(os.environ, PYTHONPATH=str(path)),
                               capture_output=True, text=True, timeout=3600)
            line = [x for x in p.stdout.splitlines() if x.startswith("RESULT")]
            if not line:
                raise RuntimeError(f"{tree} worker failed:\n{p.stderr[-3000:]}")
            got[tree].append(json.loads(line[0][len("RESULT"):]))
            print(f"round {r} {tree}: " + " ".join(f"{x['decode_tok_s']:.0f}" for x in got[tree][-1]), flush=True)
    out = {}
    for i, (d, c, b) in enumerate(COST):
        row = {}
        for metric in ("decode_tok_s", "tok_per_cpu_s"):
            new = statistics.median(x[i][metric] for x in got["new"])
            base = statistics.median(x[i][metric] for x in got["baseline"])
            row[metric] = {"new_median": round(new, 1), "baseline_median": round(base, 1), "ratio": round(new / base, 3)}
        row["rounds_new"] = [round(x[i]["decode_tok_s"], 1) for x in got["new"]]
        row["rounds_baseline"] = [round(x[i]["decode_tok_s"], 1) for x in got["baseline"]]
        out[f"{d}/{c}/batch{b}"] = row
    return out


def attention_section(rounds: int, threads: int, max_tokens: int) -> dict:
    """The fixed-split attention alone: one process, one LLM per (config, batch), its attention switched between
    the fixed split and PyTorch's SDPA (the previous kernel) for alternate generate calls; tokens per CPU second."""
    from specmoe import LLM, SamplingParams
    from specmoe.models import attention as A
    from specmoe.models import decoder
    fixed = A.attention

    def sdpa(q, k, v, mask, scale, key_len, sinks=None, invariant=True):
        return fixed(q, k[:, :, :key_len], v[:, :, :key_len], None if mask is None else mask[..., :key_len], scale,
                     key_len, sinks, invariant=False)
    texts, out = prompts(16), {}
    for cname in ("ar", "specmoe-self"):
        llm = LLM(threads=threads, dtype="bfloat16", **CONFIGS[cname])
        for B in (1, 16):
            got = {"fixed": [], "sdpa": []}
            for r in range(rounds):
                for name in (("fixed", "sdpa") if r % 2 == 0 else ("sdpa", "fixed")):
                    decoder.attention = fixed if name == "fixed" else sdpa
                    llm.generate(texts[:B], SamplingParams(max_tokens=4, ignore_eos=True))
                    c0 = time.process_time()
                    o = llm.generate(texts[:B], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
                    got[name].append(sum(len(x.token_ids) for x in o) / (time.process_time() - c0))
            decoder.attention = fixed
            f, s_ = statistics.median(got["fixed"]), statistics.median(got["sdpa"])
            out[f"bfloat16/{cname}/batch{B}"] = {"fixed_tok_per_cpu_s": round(f, 1), "sdpa_tok_per_cpu_s": round(s_, 1),
                                                 "ratio": round(f / s_, 3), "rounds": rounds}
            print(json.dumps({f"bfloat16/{cname}/batch{B}": out[f"bfloat16/{cname}/batch{B}"]}), flush=True)
        llm.close()
    return out


def commit() -> str:
    try:
        h = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return h + ("+dirty" if dirty else "")
    except OSError:
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", type=Path, help="checkout of the commit before the fix (for the cost section)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--cost-tokens", type=int, default=48)
    ap.add_argument("--sections", default="generate,server,attention,cost")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--baseline-results", type=Path,
                    help="this script's JSON from a run in the baseline checkout: kept under 'baseline'")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    import torch

    from specmoe.weights.checkpoint import resolve_dtype
    torch.set_num_threads(a.threads)
    res = json.loads(a.out.read_text()) if a.out.is_file() else {}
    res.update({"commit": commit(), "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
                "threads": a.threads, "max_tokens": a.max_tokens, "date": time.strftime("%Y-%m-%d"),
                "default_dtype": str(resolve_dtype("auto", default="bfloat16", device="cpu")).replace("torch.", "")})
    try:
        from specmoe.machine_cache import cpu_model
        res["cpu"] = cpu_model()
    except ImportError:
        pass
    sections = a.sections.split(",")
    if "generate" in sections:
        res["generate"] = generate_section(a.threads, a.max_tokens)
    if "server" in sections:
        res["server"] = server_section(a.threads, a.max_tokens)
    if "attention" in sections:
        res["attention"] = attention_section(a.rounds, a.threads, a.cost_tokens)
    if "cost" in sections:
        if a.baseline is None:
            ap.error("the cost section needs --baseline DIR")
        res["cost"] = cost_section(a.baseline, a.rounds, a.threads, a.cost_tokens)
        res["cost_commit_baseline"] = str(a.baseline)
    if a.baseline_results is not None:
        b = json.loads(a.baseline_results.read_text())
        res["baseline"] = {k: b[k] for k in ("commit", "generate", "server") if k in b}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
