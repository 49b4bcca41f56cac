"""Expert offloading on the disk tier: tokens/s, bytes moved per token and hit rate of the
cache policies (docs/ARCHITECTURE.md) at several batch sizes, plus a page-cache vs
O_DIRECT read comparison showing the direct path really reads the SSD. Not a test.

    .venv/bin/python benchmarks/offload_bench.py [--model DIR] [--batches 1,16,64] [--max-tokens 32]
        [--cache-frac 0.25] [--threads 1] [--out results.json]

Every run is greedy with EOS ignored, on the same prompts (benchmarks/prompts/*.jsonl, domains
interleaved, truncated to --prompt-tokens), starting from a cold cache (unpinned experts
evicted, counters reset) after one warm-up run. `overlap-oracle` records an identical run
first and measures the replay, prefetching the exact union each next layer asked for: an
upper bound for overlap with a perfect predictor on the same I/O channel.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from specmoe import LLM, SamplingParams  # noqa: E402
from specmoe.memory import aligned_empty  # noqa: E402

CONFIGS = {  # name -> OffloadConfig fields (all on the disk tier)
    "ondemand": {"cache_policy": "ondemand"},
    "static": {"cache_policy": "static"},
    "lru": {"cache_policy": "lru"},
    "lfu": {"cache_policy": "lfu"},
    "overlap-predicted": {"cache_policy": "ondemand", "prefetch": "predicted"},
    "overlap-oracle": {"cache_policy": "ondemand", "prefetch": "oracle"},
}


def load_prompts(llm: LLM, n: int, max_tokens: int, *, tail: bool = False) -> list[list[int]]:
    """n prompts, domains interleaved, from the start of the files (or from their end with `tail`: the
    held-out prompts the static policy's profile is made from, disjoint from the measured ones)."""
    files = sorted((REPO / "benchmarks" / "prompts").glob("*.jsonl"))
    per = [[json.loads(line)["prompt"] for line in f.read_text().splitlines() if line.strip()] for f in files]
    if tail:
        per = [rows[::-1] for rows in per]
    texts = [p for group in zip(*per) for p in group] if per else []
    if llm.tokenizer is None or not texts:
        g = torch.Generator().manual_seed(1 if tail else 0)
        return [torch.randint(0, llm.config.vocab_size, (max_tokens,), generator=g).tolist() for _ in range(n)]
    out = [t[:max_tokens] for t in (llm.tokenizer.encode(p) for p in texts) if t]
    return (out * (n // max(1, len(out)) + 1))[:n]


def write_profile(ref: LLM, repack_dir: Path, args) -> dict:
    """Profile expert activations on held-out prompts and leave the profile where the static policy looks
    for a cached one (keyed by the checkpoint fingerprint)."""
    from specmoe.experts.profiling import profile_dict, save_profile
    prompts = load_prompts(ref, args.profile_prompts, args.prompt_tokens, tail=True)
    ref.reset_stats()
    ref.generate(prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    prof = profile_dict(ref.stats["expert_counts"], ref.config, fingerprint=ref.ckpt.fingerprint(),
                        source=f"offload_bench: {len(prompts)} held-out prompts, 16 tokens each")
    save_profile(repack_dir / "expert_profile.json", prof)
    return prof


def measure(llm: LLM, prompts, params) -> dict:
    llm.reset_stats()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    s = {"hit_rate": 1.0, "hits": 0, "misses": 0, "fetch_wait_s": 0.0, "expert_compute_s": 0.0, "prefetch_useful": 0,
         "prefetch_wasted": 0, "scratch_fetches": 0, "oracle_mismatches": 0, "direct_io": False, **llm.stats}
    gen = sum(len(o.token_ids) for o in outs)
    return {"tokens_per_s": gen / wall, "decode_tokens_per_s": s["decode_tokens_per_s"], "wall_s": wall,
            "generated_tokens": gen, "bytes_moved": s["bytes_moved"], "bytes_per_token": s["bytes_moved"] / gen,
            "hit_rate": s["hit_rate"], "hits": s["hits"], "misses": s["misses"], "fetch_wait_s": s["fetch_wait_s"],
            "expert_compute_s": s["expert_compute_s"], "prefetch_useful": s["prefetch_useful"],
            "prefetch_wasted": s["prefetch_wasted"], "scratch_fetches": s["scratch_fetches"],
            "oracle_mismatches": s["oracle_mismatches"], "direct_io": s["direct_io"],
            "token_ids": [o.token_ids for o in outs]}


def tier_options(args, repack_dir: Path) -> dict:
    if args.tier == "disk":
        return {"offload": "disk", "repack_dir": repack_dir}
    link = {"link_gbps": args.link_gbps, "link_latency_us": args.link_latency_us} if args.link_gbps else {}
    return {"offload": "host", **link}


def run_batch(b: int, systems: dict, args, prompts_all, ref_tokens: dict) -> list:
    """Every system at batch b, interleaved: `repeats` rounds over all systems, the fastest run of each
    reported, so each system is measured in the same stretch of a shared machine's load."""
    prompts = prompts_all[:b]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    for name, llm in systems.items():
        llm.generate(prompts[: min(b, 4)], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up
        if getattr(llm.store, "prefetch", None) == "oracle":  # record this exact run, replay it below
            llm.store.evict_all()
            llm.store.start_oracle_recording()
            llm.generate(prompts, params)
    reps = {name: [] for name in systems}
    for _ in range(args.repeats):
        for name, llm in systems.items():
            if hasattr(llm.store, "evict_all"):
                if llm.store.prefetch == "oracle":
                    llm.store.start_oracle_replay()
                llm.store.evict_all()
            reps[name].append(measure(llm, prompts, params))
    rows = []
    for name, runs in reps.items():
        r = min(runs, key=lambda x: x["wall_s"])
        r["repeats_tokens_per_s"] = [x["tokens_per_s"] for x in runs]
        toks = r.pop("token_ids")
        if name == "resident":
            ref_tokens[b] = toks
        r.update(system=name, batch=b, cache_experts=systems[name].store.stats().get("cache_slots_per_layer"),
                 lossless=toks == ref_tokens[b])
        rows.append(r)
        print(f"  {name:>18} B={b:<3} {r['tokens_per_s']:8.1f} tok/s  {r['bytes_per_token'] / 1e3:9.1f} KB/tok  "
              f"hit {r['hit_rate']:.3f}  wait {r['fetch_wait_s']:.2f}s", flush=True)
    return rows


def read_comparison(file: Path, stride: int, n: int, reps: int = 3) -> dict:
    """Same expert reads via warm buffered reads (page cache) vs O_DIRECT (SSD)."""
    size = file.stat().st_size
    offsets = random.Random(0).sample(range(size // stride), min(n, size // stride))
    offsets = [o * stride for o in offsets]
    buf = aligned_empty(stride)
    mv = buf.numpy()
    fd = os.open(file, os.O_RDONLY)
    for o in offsets:  # warm the page cache
        os.preadv(fd, [mv], o)
    t0 = time.perf_counter()
    for _ in range(reps):
        for o in offsets:
            os.preadv(fd, [mv], o)
    buffered = (time.perf_counter() - t0) / (reps * len(offsets))
    t0 = time.perf_counter()
    for _ in range(reps):
        for o in offsets:  # evicted from the page cache first: a buffered read that must go to the SSD
            os.posix_fadvise(fd, o, stride, os.POSIX_FADV_DONTNEED)
            os.preadv(fd, [mv], o)
    cold = (time.perf_counter() - t0) / (reps * len(offsets))
    os.close(fd)
    fd = os.open(file, os.O_RDONLY | os.O_DIRECT)
    t0 = time.perf_counter()
    for _ in range(reps):
        for o in offsets:
            os.preadv(fd, [mv], o)
    direct = (time.perf_counter() - t0) / (reps * len(offsets))
    os.close(fd)
    return {"expert_read_bytes": stride, "reads": reps * len(offsets), "buffered_warm_us": buffered * 1e6,
            "buffered_cold_us": cold * 1e6, "direct_us": direct * 1e6, "buffered_warm_GBps": stride / buffered / 1e9, "direct_GBps": stride / direct / 1e9}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=str(REPO / "models" / "specmoe-tiny-moe"), help="checkpoint directory")
    ap.add_argument("--batches", default="1,16,64", help="comma-separated batch sizes")
    ap.add_argument("--max-tokens", type=int, default=32, help="tokens generated per sequence")
    ap.add_argument("--prompt-tokens", type=int, default=64, help="prompt length cap (tokens)")
    ap.add_argument("--cache-frac", type=float, default=0.25, help="device cache slots as a share of experts per layer")
    ap.add_argument("--systems", default=",".join(CONFIGS), help=f"subset of {','.join(CONFIGS)}")
    ap.add_argument("--tier", default="disk", choices=("disk", "host"), help="backing tier of the experts")
    ap.add_argument("--link-gbps", type=float, default=None, help="host tier: emulated link bandwidth, GB/s")
    ap.add_argument("--link-latency-us", type=float, default=None, help="host tier: emulated link latency, us")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--repeats", type=int, default=2, help="measured runs per point (the fastest is reported)")
    ap.add_argument("--profile-prompts", type=int, default=64, help="held-out prompts for the static policy's "
                    "profile when the checkpoint ships no expert_profile.json (0: the policy profiles itself on "
                    "built-in prompts)")
    ap.add_argument("--repack-dir", default=None, help="where the aligned expert repack goes (default: a temp dir)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    args.batches = [int(b) for b in args.batches.split(",")]
    torch.set_num_threads(args.threads)
    repack_dir = Path(args.repack_dir or tempfile.mkdtemp(prefix="specmoe-repack-"))

    ref = LLM(args.model, max_batch=max(args.batches))  # resident reference, for the lossless check
    cfg = ref.config
    slots = max(cfg.top_k, round(args.cache_frac * cfg.num_experts))
    prompts = load_prompts(ref, max(args.batches), args.prompt_tokens)
    print(f"model {args.model}: {cfg.model_type}, {len(cfg.moe_layers)} MoE layers x {cfg.num_experts} experts "
          f"(top-{cfg.top_k}), cache {slots} experts/layer, {args.tier} tier"
          f"{' behind an EMULATED link' if args.tier == 'host' and args.link_gbps else ''}, {args.threads} thread(s)",
          flush=True)
    ref_tokens, rows = {}, []
    shipped = Path(args.model) / "expert_profile.json"
    prof = None
    if shipped.is_file():  # the static policy prefers the checkpoint's own profile
        from specmoe.experts.profiling import load_profile, skewness
        prof = {"source": str(shipped), "skewness": [round(skewness(r), 4) for r in load_profile(shipped, cfg)]}
    elif args.profile_prompts:
        prof = write_profile(ref, repack_dir, args)
    if prof:
        print(f"static-policy profile: {prof['source']}; skewness per layer {prof['skewness']}", flush=True)
    systems = {"resident": ref}
    for name in args.systems.split(","):
        systems[name] = LLM(args.model, cache_experts=slots, max_batch=max(args.batches),
                            **tier_options(args, repack_dir), **CONFIGS[name])
    for b in args.batches:
        rows += run_batch(b, systems, args, prompts, ref_tokens)

    probe = LLM(args.model, offload="disk", cache_experts=slots, repack_dir=repack_dir)
    tier = probe.store.tier
    reads = read_comparison(tier.rp.file, tier.stride, n=64)

    hdr = f"{'system':>30} {'B':>3} {'tok/s':>8} {'bytes/token':>12} {'hit rate':>8} {'wait s':>7} {'pf use/waste':>12} lossless"
    print("\n" + hdr + "\n" + "-" * len(hdr))
    for r in rows:
        pf = f"{r['prefetch_useful']}/{r['prefetch_wasted']}" if r["prefetch_useful"] + r["prefetch_wasted"] else "-"
        print(f"{r['system']:>30} {r['batch']:>3} {r['tokens_per_s']:8.1f} {r['bytes_per_token']:12.0f} "
              f"{r['hit_rate']:8.3f} {r['fetch_wait_s']:7.2f} {pf:>12} {r['lossless']}")
    print(f"\nexpert read of {reads['expert_read_bytes']} B: page cache (warm, buffered) {reads['buffered_warm_us']:.1f} us "
          f"({reads['buffered_warm_GBps']:.2f} GB/s), page cache dropped first {reads['buffered_cold_us']:.1f} us, "
          f"O_DIRECT {reads['direct_us']:.1f} us "
          f"({reads['direct_GBps']:.2f} GB/s) over {reads['reads']} reads")
    if args.out:
        meta = {"model": args.model, "model_type": cfg.model_type, "moe_layers": len(cfg.moe_layers),
                "experts": cfg.num_experts, "top_k": cfg.top_k, "cache_experts": slots, "max_tokens": args.max_tokens,
                "prompt_tokens": args.prompt_tokens, "threads": args.threads, "machine": platform.machine(),
                "cpus": os.cpu_count(), "load_avg": os.getloadavg(), "tier": args.tier,
                "emulated_link": bool(args.tier == "host" and args.link_gbps), "link_gbps": args.link_gbps,
                "link_latency_us": args.link_latency_us,
                "direct_io": bool(tier.direct_io), "bytes_per_expert": tier.expert_bytes}
        meta["static_profile"] = prof["source"] if prof else "auto (built-in prompts)"
        meta["skewness_per_layer"] = prof["skewness"] if prof else None
        meta["repeats"] = args.repeats
        from specmoe.bench.machine import provenance
        Path(args.out).write_text(json.dumps({"command": "python " + " ".join(sys.argv), "provenance": provenance(),
                                              "meta": meta, "rows": rows, "reads": reads}, indent=1))
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
