"""Expert cache policies on natural text: the demo model's routing, recorded once by teacher forcing over held-out
documents, replayed through each policy's bookkeeping (specmoe/experts/replay.py) at several cache sizes.

    python benchmarks/cache_policy_bench.py [--per-domain 3] [--prompt-tokens 32] [--max-tokens 160]
                                            [--slots 4 8 16] [--policies lru lfu adaptive s3fifo]

Workload: `per_domain` documents of each of the four domains of benchmarks/prompts/ (specmoe/bench/documents.py,
the over-RAM benchmark's natural-forced documents): each is a prompt (prefilled as one forward) then its forced
continuation decoded one token at a time at batch 1, the documents one after another through one cache (as one
process serving them in turn). The routing of every forward comes from one forward over the document's tokens
(teacher forcing: each token's top-k is what a batch-1 decode of it routes). Hit rates count decode steps only;
prefill unions go through the bookkeeping uncounted. `belady` is the offline optimum (evict the expert needed
again farthest in the future), a bound no online policy reaches.

Check: the first document is also decoded for real (disk tier, forced tokens, each policy at the middle cache
size) and the engine's hits and misses compared with the replay of that document alone (`engine_check`).
Writes benchmarks/results/cache_policy.json (+ .png).
"""
from __future__ import annotations

import argparse
import bisect
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from specmoe import LLM, SamplingParams  # noqa: E402
from specmoe.bench.documents import build_documents  # noqa: E402
from specmoe.bench.machine import machine_info  # noqa: E402
from specmoe.bench.plots import write_results  # noqa: E402
from specmoe.decoding.runtime.sequence import Sequence  # noqa: E402
from specmoe.engine.llm import default_model_path  # noqa: E402
from specmoe.experts.replay import replay  # noqa: E402


def record(llm: LLM, tokens: list[int]) -> list[list[list[int]]]:
    """stream[moe layer][token]: each token's sorted top-k expert ids, from one forward over `tokens`."""
    got = {}

    def observe(layer, routing):
        got[layer] = [sorted(set(r)) for r in routing.ids[: routing.real_tokens].tolist()]

    runner = llm.runner(1, len(tokens))
    seq = Sequence(seq_id=0, prompt_ids=list(tokens), params=SamplingParams(), slot=0, generator=torch.Generator())
    runner.forward([seq], [list(tokens)], ctx=runner.context(observers=[observe]))
    return [got[layer] for layer in llm.config.moe_layers]


def doc_stream(llm: LLM, doc) -> list[list[list[int]]]:
    """The forwards of a forced batch-1 decode of `doc`: the prompt's union (prefill), then each forced token but
    the last (its successor is never asked for)."""
    per_token = record(llm, doc.prompt + doc.forced[:-1])
    P = len(doc.prompt)
    return [[sorted({e for ids in layer[:P] for e in ids})] + layer[P:] for layer in per_token]


def belady(stream, slots: int, counted: list[bool]) -> tuple[int, int]:
    """Offline optimum per layer: on a miss with every slot full, evict the resident expert (not this forward's)
    needed again farthest ahead. Returns (hits, misses) over the counted steps."""
    hits = misses = 0
    for steps in stream:
        uses: dict[int, list[int]] = {}
        for i, ids in enumerate(steps):
            for e in ids:
                uses.setdefault(e, []).append(i)
        resident: set[int] = set()
        for i, ids in enumerate(steps):
            for e in ids:
                if e in resident:
                    hits += counted[i]
                    continue
                misses += counted[i]
                if len(resident) >= slots:
                    def next_use(x):
                        u = uses[x]
                        j = bisect.bisect_right(u, i)
                        return u[j] if j < len(u) else float("inf")
                    cands = [x for x in resident if x not in ids]
                    if not cands:
                        continue
                    resident.discard(max(cands, key=next_use))
                resident.add(e)
    return hits, misses


def engine_check(path, doc, policies, slots: int, stream) -> list[dict]:
    out = []
    for p in policies:
        llm = LLM(path, offload="disk", cache_policy=p, cache_experts=slots)
        t0 = time.perf_counter()
        o = llm.generate([doc.prompt], SamplingParams(max_tokens=len(doc.forced), temperature=0.0, ignore_eos=True,
                                                      forced_tokens=doc.forced))
        wall = time.perf_counter() - t0
        s = llm.stats
        r = replay(p, stream, slots, llm.config.num_experts)
        out.append({"policy": p, "slots": slots, "engine_hits": s["hits"], "engine_misses": s["misses"],
                    "replay_hits": r.hits, "replay_misses": r.misses,
                    "match": (s["hits"], s["misses"]) == (r.hits, r.misses),
                    "forced_tokens_out": o[0].token_ids == doc.forced, "wall_s": round(wall, 3)})
        llm.close()
        print(out[-1], flush=True)
    return out


def draw(res, png):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    sizes = res["slots"]
    names = res["policies"] + ["belady"]
    w = 0.8 / len(names)
    for k, name in enumerate(names):
        ax.bar([i + k * w for i in range(len(sizes))], [res["hit_rate"][name][str(s)] for s in sizes], w, label=name)
    ax.set_xticks([i + 0.4 - w / 2 for i in range(len(sizes))], [f"{s} of {res['num_experts']} slots" for s in sizes])
    ax.set_ylabel("decode hit rate")
    ax.set_title(f"expert cache policies, demo model, {res['documents']} natural documents (forced, batch 1)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-domain", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--slots", type=int, nargs="+", default=[4, 8, 16])
    ap.add_argument("--policies", nargs="+", default=["lru", "lfu", "adaptive", "s3fifo"])
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "cache_policy.json"))
    args = ap.parse_args()
    path = default_model_path()
    llm = LLM(path)
    E = llm.config.num_experts
    docs = build_documents(llm.tokenizer.encode, REPO / "benchmarks" / "prompts", per_domain=args.per_domain,
                           prompt_tokens=args.prompt_tokens, max_tokens=args.max_tokens)
    streams = [doc_stream(llm, d) for d in docs]
    layers = len(llm.config.moe_layers)
    whole = [[step for s in streams for step in s[li]] for li in range(layers)]
    counted = [i > 0 for s in streams for i in range(len(s[0]))]
    hit_rate, per_domain = {}, {}
    for name in args.policies + ["belady"]:
        hit_rate[name], per_domain[name] = {}, {}
        for slots in args.slots:
            if name == "belady":
                h, m = belady(whole, slots, counted)
            else:
                r = replay(name, whole, slots, E, counted)
                h, m = r.hits, r.misses
            hit_rate[name][str(slots)] = round(h / (h + m), 4)
            dom = {}
            for d, s in zip(docs, streams):  # each document alone, cold cache: the spread across domains
                c = [i > 0 for i in range(len(s[0]))]
                if name == "belady":
                    hd, md = belady(s, slots, c)
                else:
                    rd = replay(name, s, slots, E, c)
                    hd, md = rd.hits, rd.misses
                dom.setdefault(d.domain, [0, 0])
                dom[d.domain][0] += hd
                dom[d.domain][1] += md
            per_domain[name][str(slots)] = {k: round(v[0] / sum(v), 4) for k, v in dom.items()}
        print(name, hit_rate[name], flush=True)
    distinct = [[len({e for ids in s[li][1:] for e in ids}) for li in range(layers)] for s in streams]
    best = {str(s): max(args.policies, key=lambda n: hit_rate[n][str(s)]) for s in args.slots}
    mid = args.slots[len(args.slots) // 2]
    check = engine_check(path, docs[0], args.policies, mid, streams[0])
    res = {"benchmark": "cache_policy", "command": " ".join(["python"] + sys.argv), "model": str(path),
           "num_experts": E, "moe_layers": layers, "top_k": llm.config.top_k, "documents": len(docs),
           "document_ids": [list(d.ids) for d in docs], "domains": sorted({d.domain for d in docs}),
           "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
           "decode_steps": sum(counted), "slots": args.slots, "policies": args.policies,
           "hit_rate": hit_rate, "hit_rate_per_domain_cold": per_domain, "best_online_policy": best,
           "distinct_experts_per_layer_per_document": distinct, "engine_check": check,
           "machine": machine_info(path)}
    write_results(res, args.out, draw)


if __name__ == "__main__":
    main()
