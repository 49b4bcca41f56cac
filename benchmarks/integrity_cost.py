"""Cost of the disk tier's per-read checksum, against the read it follows.

    python benchmarks/integrity_cost.py [--model DIR] [--widened] [--repack-dir DIR] [--passes N] [--tokens N]

Two measurements, both on the disk tier (O_DIRECT reads of the aligned repack):
- isolated: every expert read once per pass in random order through `DiskTier.read_into` on one
  thread; per expert, the time in `preadv` and the time in the checksum (the tier's own counters),
  and the time of one bare pass (a uint64 sum) over freshly read bytes: the floor of any checksum
  that reads every byte;
- engine: greedy generation with `cache_policy="ondemand"` (every routed expert is read from the SSD
  in every forward); per expert read, `io_read_s` and `io_verify_s` from `llm.stats` (I/O thread).
`--widened` runs on a function-preserving widened copy of the model (~6 MiB experts, specmoe.bench.widen),
built once under ~/.cache/specmoe/integrity-bench (about 1.2 GB, plus its repack).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from specmoe import LLM, SamplingParams  # noqa: E402
from specmoe.engine.llm import DEMO_MODEL  # noqa: E402
from specmoe.memory import aligned_empty  # noqa: E402
from specmoe.experts.repack import open_repack  # noqa: E402
from specmoe.experts.tiers import DiskTier  # noqa: E402
from specmoe.weights.checkpoint import Checkpoint, resolve_dtype  # noqa: E402


def isolated(model: Path, repack_dir: Path, passes: int) -> dict:
    ck = Checkpoint(model)
    tier = DiskTier(open_repack(ck, resolve_dtype(None, default=ck.config.dtype), repack_dir))
    ids = [(layer, e) for layer in ck.config.moe_layers for e in range(ck.config.num_experts)]
    buf = aligned_empty(tier.stride)
    for _ in range(passes):
        random.shuffle(ids)
        for layer, e in ids:
            tier.read_into(layer, e, buf)
    # the floor of any checksum over every byte: one bare pass (a uint64 sum) over freshly read bytes
    floor = 0.0
    for layer, e in ids:
        os.preadv(tier.fd, [buf.numpy()], tier.rp.offset(layer, e))
        t0 = time.perf_counter()
        buf.numpy().view(np.uint64).sum()
        floor += time.perf_counter() - t0
    tier.close()
    return {"expert_bytes": tier.stride, "reads": tier.reads, "read_us": 1e6 * tier.read_s / tier.reads,
            "verify_us": 1e6 * tier.verify_s / tier.reads, "verify_over_read": tier.verify_s / tier.read_s,
            "bare_sum_us": 1e6 * floor / len(ids)}


def engine(model: Path, repack_dir: Path, tokens: int) -> dict:
    torch.set_num_threads(1)
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12, 13], [14, 15, 16, 17]]
    with LLM(model, offload="disk", cache_policy="ondemand", repack_dir=repack_dir, max_batch=4) as llm:
        llm.generate(prompts[:1], SamplingParams(max_tokens=2))  # warm-up
        llm.reset_stats()
        t0 = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=tokens, ignore_eos=True))
        wall = time.perf_counter() - t0
        s = llm.stats
    n = s["io_reads"]
    return {"wall_s": wall, "reads": n, "fetch_wait_us_per_miss": 1e6 * s["fetch_wait_s"] / s["misses"],
            "read_us": 1e6 * s["io_read_s"] / n, "verify_us": 1e6 * s["io_verify_s"] / n,
            "verify_over_read": s["io_verify_s"] / s["io_read_s"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=DEMO_MODEL)
    p.add_argument("--widened", action="store_true", help="measure on the widened copy (~6 MiB experts)")
    p.add_argument("--repack-dir", type=Path, default=None)
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--tokens", type=int, default=16)
    a = p.parse_args()
    model = a.model
    cache = Path.home() / ".cache" / "specmoe" / "integrity-bench"
    if a.widened:
        from specmoe.bench.widen import default_size, widen_checkpoint
        D2, I2 = default_size(model)
        model = cache / f"{a.model.name}-widened-d{D2}-i{I2}"
        if not (model / "config.json").is_file():
            widen_checkpoint(a.model, model, hidden=D2, expert_intermediate=I2, progress=True)
    repack_dir = a.repack_dir or cache / f"repack-{model.name}"
    out = {"model": str(model), "isolated": isolated(model, repack_dir, a.passes),
           "engine": engine(model, repack_dir, a.tokens)}
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
