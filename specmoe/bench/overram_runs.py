"""An MoE checkpoint larger than RAM, streamed from SSD at batch 1, against llama.cpp (benchmarks/over_ram.py).

Artifacts (`build_artifacts`, under a cache directory outside the repository): a function-preserving widened copy
of the demo model (`widen.widened_copy`, its weight files written sparse: they are only read to build the other
two), the specmoe disk tier's repack of its experts and llama.cpp's bf16 GGUF (`peers.convert_gguf`); both are
checked to be fully allocated, since reads of a hole would never reach the SSD. Disk space is checked first: a disk
that cannot hold them is refused with the numbers.

Runs: every system runs in a fresh process (`child_specmoe` here, `llama_child.py` for llama.cpp), after the model
files were dropped from the page cache, and reports its per-token timeline (sysprobe.Timeline); the parent
(`run_child`) samples its memory and the machine's MemAvailable, and the page-cache residency of the files before
and after.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from specmoe.bench import sysprobe
from specmoe.errors import InputError

RESULT_TAG = "OVERRAM-RESULT "  # a child's last stdout line: this tag + its JSON result
LLAMA_CHILD = Path(__file__).with_name("llama_child.py")
SPECMOE = {  # name -> LLM options (all on the disk tier, greedy, batch 1)
    "lru": {"decoding": "ar", "cache_policy": "lru"},
    "auto": {"decoding": "auto"},  # the disk tier's default cache policy (s3fifo)
}


def fixed_options(name: str) -> dict:
    """A fixed speculative system named as benchmarks/auto_bench.py names them: '<drafter>-g<γ>[-tree]'."""
    parts = name.split("-")
    if len(parts) not in (2, 3) or parts[0] not in ("self", "eagle", "ngram") or not parts[1][1:].isdigit() \
            or parts[1][0] != "g" or (len(parts) == 3 and parts[2] != "tree"):
        raise InputError(f"fixed system {name!r}: expected <self|eagle|ngram>-g<gamma>[-tree], e.g. eagle-g4")
    return {"decoding": "specmoe", "drafter": parts[0], "num_draft_tokens": int(parts[1][1:]),
            "draft_tree": len(parts) == 3, "cache_policy": "lru"}


POLICIES = ("s3fifo", "adaptive", "lfu")  # also systems: plain decoding with that cache policy


def system_options(name: str) -> dict:
    if name in POLICIES:
        return {"decoding": "ar", "cache_policy": name}
    return SPECMOE[name] if name in SPECMOE else fixed_options(name)


@dataclass(frozen=True)
class Sizes:
    """The widened copy: hidden size (D'/D a power of 4, exact in bf16) and MiB per expert."""
    hidden: int
    expert_mb: float


BIG = Sizes(hidden=4096, expert_mb=144.0)  # demo 256 → 4096; I' 96 → 6144: 144 MiB per expert, 27 GiB of experts
MID = Sizes(hidden=4096, expert_mb=48.0)  # I' 2048: 48 MiB per expert, ~9 GiB of experts (vs_llamacpp's widened4096)
DRY = Sizes(hidden=1024, expert_mb=1.0)  # the dry run's tiny copy: ~0.2 GiB
MODELS = {"big": BIG, "mid": MID, "dry": DRY}


# ---------------------------------------------------------------- artifacts
def plan_bytes(src: Path, sizes: Sizes) -> dict:
    """What the artifacts of `sizes` will weigh, from the source's config (nothing is built): widened expert and
    non-expert bytes, the repack (4 KiB-aligned experts), the GGUF (every weight in bf16)."""
    from specmoe.bench.widen import default_size
    from specmoe.memory import round_up
    from specmoe.weights.checkpoint import Checkpoint
    ck = Checkpoint(src)
    cfg = ck.config
    D2, I2 = default_size(src, hidden=sizes.hidden, expert_mb=sizes.expert_mb)
    esize = 2  # bf16
    expert = 3 * I2 * D2 * esize
    n_exp = cfg.num_experts * len(cfg.moe_layers)
    src_bytes = sum(os.path.getsize(src / f) for f in set(ck.key_to_file.values()))
    src_expert = cfg.expert_numel * n_exp * esize
    non_expert = (src_bytes - src_expert) * D2 // cfg.hidden_size  # every non-expert tensor grows ~linearly in D
    return {"hidden": D2, "expert_intermediate": I2, "expert_bytes": expert, "experts": n_exp,
            "expert_total_bytes": expert * n_exp, "non_expert_bytes": non_expert,
            "model_bytes": expert * n_exp + non_expert, "repack_bytes": round_up(expert, 4096) * n_exp,
            "gguf_bytes": expert * n_exp + non_expert, "sparse_copy_bytes": 2 * non_expert + src_bytes}


def check_disk(cache_dir: Path, need: dict[str, int], margin: int = 1 << 30) -> dict:
    """Refuse (InputError with need vs free) when `cache_dir`'s disk cannot hold the artifacts still missing."""
    free = shutil.disk_usage(cache_dir).free
    total = sum(need.values()) + margin
    if total > free:
        parts = ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in need.items())
        raise InputError(f"not enough disk for the over-RAM artifacts in {cache_dir}: need {total / 1e9:.2f} GB "
                         f"({parts}, margin {margin / 1e9:.2f} GB), free {free / 1e9:.2f} GB")
    return {"need_bytes": total, "free_bytes": free, "parts": need}


def _fully_allocated(path: Path, what: str) -> dict:
    a = sysprobe.allocation(path)
    if a["allocated_bytes"] < 0.99 * a["apparent_bytes"]:
        raise InputError(f"{what} {path} is sparse ({a['allocated_bytes'] / 1e9:.2f} of {a['apparent_bytes'] / 1e9:.2f} "
                         "GB allocated): reads of its holes would never reach the SSD; delete it and rebuild")
    return a


def build_artifacts(src: Path, cache_dir: Path, sizes: Sizes, *, gguf: bool, llama_src: str | None,
                    progress: bool = True, dtype: str = "auto") -> dict:
    """The widened copy (sparse), its repack and (`gguf`) its bf16 GGUF under `cache_dir`, built once; each step
    timed; the copy checked (greedy, compute dtype `dtype`) against the source on the disk tier."""
    import torch

    from specmoe.bench.peers import convert_gguf, gguf_path
    from specmoe.bench.widen import default_size, greedy_check, widened_copy
    from specmoe.experts.repack import file_base, find_repack, open_repack
    from specmoe.weights.checkpoint import Checkpoint
    cache_dir.mkdir(parents=True, exist_ok=True)
    plan = plan_bytes(src, sizes)
    repack_dir = cache_dir / "repack"
    D2, I2 = default_size(src, hidden=sizes.hidden, expert_mb=sizes.expert_mb)
    copies = list(cache_dir.glob(f"{src.name}-widened-d{D2}-i{I2}-*/widen.json"))
    need = {}
    if not copies:
        need["widened copy (sparse)"] = plan["sparse_copy_bytes"]
    if not copies or find_repack(Checkpoint(copies[0].parent), torch.bfloat16, repack_dir) is None:
        need["repack"] = plan["repack_bytes"]
    if gguf and (not copies or not gguf_path(copies[0].parent, cache_dir).is_file()):
        need["gguf"] = plan["gguf_bytes"]
    info = {"plan": plan, "disk": check_disk(cache_dir, need), "steps_s": {}}
    t0 = time.perf_counter()
    path, winfo = widened_copy(src, cache_dir=cache_dir, hidden=sizes.hidden, expert_mb=sizes.expert_mb,
                               sparse=True, check_dtypes=(), progress=progress)
    info["steps_s"]["widen"] = time.perf_counter() - t0
    info.update(path=str(path), widen={k: v for k, v in winfo.items() if k != "greedy_check"})
    ck = Checkpoint(path)
    t0 = time.perf_counter()
    rp = open_repack(ck, torch.bfloat16, repack_dir, progress=progress)
    info["steps_s"]["repack_open_or_build"] = time.perf_counter() - t0
    info["repack"] = {"file": str(rp.file), "manifest": str(rp.manifest), "base": file_base(ck, torch.bfloat16),
                      "expert_bytes": rp.expert_bytes, "stride": rp.stride,
                      **_fully_allocated(rp.file, "the expert repack file")}
    marker = path / f"overram-check-{dtype}.json"  # the copy's greedy check on the disk tier, once per copy and dtype
    if marker.is_file():
        info["greedy_check"] = json.loads(marker.read_text())
    else:
        t0 = time.perf_counter()
        opts = {"offload": "disk", "repack_dir": str(repack_dir), "cache_experts": 2 * ck.config.top_k}
        info["greedy_check"] = greedy_check(src, path, dtype=dtype, prompts=[[1, 2, 3, 4, 5, 6, 7, 8]],
                                            max_tokens=8, options=opts)
        info["greedy_check"]["s"] = time.perf_counter() - t0
        marker.write_text(json.dumps(info["greedy_check"]))
    if gguf:
        t0 = time.perf_counter()
        timeout = max(900.0, plan["gguf_bytes"] / 10e6)  # ≥ 10 MB/s of conversion
        g, ginfo = convert_gguf(path, cache_dir, llama_src, timeout=timeout)
        info["steps_s"]["gguf_convert_or_find"] = time.perf_counter() - t0
        info["gguf"] = {**{k: v for k, v in ginfo.items() if k != "convert_log_tail"}, "file": str(g),
                        **_fully_allocated(g, "the GGUF")}
    info["safetensors"] = [{"file": str(path / f), **sysprobe.allocation(path / f)}
                           for f in sorted(set(ck.key_to_file.values()))]
    return info


def warm_caches(path: Path, repack_dir: Path, prompt: list[int], dtype: str = "auto") -> dict:
    """What `decoding="auto"` computes once per model and caches on disk (its cost model's calibration, the self
    draft's affinity table), computed here so that no timed run pays for it: one short auto run (the smallest
    cache auto allows: draft experts + top-k slots per layer). Seconds taken."""
    from specmoe import LLM, SamplingParams
    t0 = time.perf_counter()
    llm = LLM(path, dtype=dtype, max_batch=1, offload="disk", repack_dir=str(repack_dir), prefetch="none",
              **SPECMOE["auto"])
    llm.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    st = llm.stats
    dt = str(llm.dtype).removeprefix("torch.")
    llm.close()
    return {"s": time.perf_counter() - t0, "controller_steps": st.get("controller_steps"), "dtype": dt}


def cost_profile(path: Path, repack_dir: Path, *, experts: int = 3) -> dict:
    """What moving one expert costs at this size, piece by piece (seconds per expert, median of `experts`):
    the O_DIRECT read of its repack stride, its checksum (integrity.py), the decode into a bf16 slot (a copy) and
    an upcast into fp32, reading it from the (sparse) safetensors, and sha256 of the same bytes (the rate of the
    repack's content fingerprint over the weight files)."""
    import hashlib
    import statistics

    import torch

    from specmoe.experts.integrity import checksum
    from specmoe.experts.repack import open_repack
    from specmoe.memory import aligned_empty
    from specmoe.weights.checkpoint import Checkpoint
    ck = Checkpoint(path)
    rp = open_repack(ck, torch.bfloat16, repack_dir)
    fd = os.open(rp.file, os.O_RDONLY | os.O_DIRECT)
    row = aligned_empty(rp.stride)
    cfg = ck.config
    ids = [(cfg.moe_layers[i % len(cfg.moe_layers)], (7 * i + 3) % cfg.num_experts) for i in range(experts)]
    t: dict[str, list[float]] = {k: [] for k in ("read_direct", "checksum", "decode_bf16_copy", "upcast_fp32",
                                                 "read_safetensors", "sha256")}
    bf = torch.empty(rp.expert_numel, dtype=torch.bfloat16)
    f32 = torch.empty(rp.expert_numel, dtype=torch.float32)
    for layer, e in ids:
        a = time.perf_counter()
        os.preadv(fd, [row.numpy()], rp.offset(layer, e))
        b = time.perf_counter()
        checksum(row[: rp.stride].numpy())
        c = time.perf_counter()
        rp.fmt.decode(row[: rp.expert_bytes], bf)
        d = time.perf_counter()
        rp.fmt.decode(row[: rp.expert_bytes], f32)
        e_ = time.perf_counter()
        x = ck.read_expert(layer, e)
        f = time.perf_counter()
        hashlib.sha256(x.view(torch.uint8).numpy()).digest()
        g = time.perf_counter()
        for k, v in zip(t, (b - a, c - b, d - c, e_ - d, f - e_, g - f)):
            t[k].append(v)
    os.close(fd)
    out = {k: statistics.median(v) for k, v in t.items()}
    out["expert_bytes"] = rp.expert_bytes
    out["read_direct_gbps"] = rp.stride / out["read_direct"] / 1e9
    return out


# ---------------------------------------------------------------- children
WINDOW_TOKENS = 64  # distinct experts per layer are counted per this many output tokens


class RoutingWindows:
    """A ForwardContext observer: the distinct experts each MoE layer routed to, per window of WINDOW_TOKENS
    output tokens, over the target model's forwards after the prefill (`at(n)`: n output tokens exist now; the
    forwards that follow count towards window n // size). A speculative verification's rejected positions count
    too: they were computed, so their experts were fetched."""

    def __init__(self, size: int = WINDOW_TOKENS):
        self.size = size
        self.window: int | None = None  # None: prefill, not counted
        self.sets: dict[int, dict[int, set[int]]] = {}  # window -> layer -> experts
        self.tokens: dict[int, int] = {}

    def at(self, n_out: int) -> None:
        self.window = n_out // self.size

    def __call__(self, layer: int, routing) -> None:
        if self.window is not None:
            self.sets.setdefault(self.window, {}).setdefault(layer, set()).update(routing.needed)

    @staticmethod
    def combine(summaries: list[dict]) -> dict:
        """Several documents' summaries: each kept, and the mean over their full windows."""
        import statistics
        full = [x["mean_distinct_per_layer_full_windows"] for x in summaries
                if x["mean_distinct_per_layer_full_windows"] is not None]
        return {"per_document": summaries, "mean_distinct_per_layer_full_windows": statistics.mean(full) if full else None,
                "window_tokens": WINDOW_TOKENS, "source": summaries[0]["source"] if summaries else None}

    def summary(self, tokens: int) -> dict:
        """Per window: its output tokens and the distinct experts of each layer; the mean over layers of the full
        windows (all of WINDOW_TOKENS tokens) and over all of them."""
        import statistics
        wins = []
        for w in sorted(self.sets):
            n = min(tokens, (w + 1) * self.size) - w * self.size
            per = {str(k): len(v) for k, v in sorted(self.sets[w].items())}
            wins.append({"window": w, "tokens": n, "distinct_per_layer": per})
        full = [statistics.mean(x["distinct_per_layer"].values()) for x in wins
                if x["tokens"] == self.size and x["distinct_per_layer"]]
        return {"window_tokens": self.size, "windows": wins,
                "mean_distinct_per_layer_full_windows": statistics.mean(full) if full else None,
                "source": "the target forwards' routing after the prefill (rejected draft positions included)"}


def sampling_of(spec: dict):
    """The request's SamplingParams for spec['workload']: 'natural-forced' (temperature 0, output token i =
    spec['forced'][i]), 'sampled' (spec['temperature'], seed spec['seed']) or 'greedy'; EOS never stops it."""
    from specmoe import SamplingParams
    w = spec.get("workload", "greedy")
    if w == "natural-forced":
        return SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, forced_tokens=list(spec["forced"]),
                              ignore_eos=True)
    if w == "sampled":
        return SamplingParams(max_tokens=spec["max_tokens"], temperature=spec["temperature"], seed=spec["seed"],
                              ignore_eos=True)
    if w == "greedy":
        return SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=True)
    raise InputError(f"unknown workload {w!r}: expected natural-forced, sampled or greedy")


def child_specmoe(spec: dict) -> dict:
    """One system's run in this (fresh) process: load, then for each of spec['docs'] ({"prompt", and "forced" or
    "seed"}) one request of spec['max_tokens'] tokens (workload: `sampling_of`), one after another,
    timed token by token; the engine's stats and memory parts, and the distinct experts per layer per window
    (RoutingWindows). A memory budget the engine refuses (InputError) is
    returned as {"status": "refused", "reason": its line}."""
    import torch

    from specmoe import LLM
    from specmoe.engine.core import Request
    torch.set_num_threads(spec["threads"])
    t0 = time.perf_counter()
    # the budget both caps all expert memory and sizes the cache (memory_budget alone only caps the default cache
    # of a quarter of the experts)
    budget = spec.get("memory_budget")
    sizing = {} if budget is None else {"memory_budget": budget, "cache_bytes": budget}
    try:
        llm = LLM(spec["path"], dtype=spec.get("dtype", "auto"), threads=spec["threads"], max_batch=1,
                  offload="disk", repack_dir=spec["repack_dir"], prefetch="none", io_depth=spec.get("io_depth", 1),
                  **sizing, **system_options(spec["system"]))
    except InputError as e:
        return {"status": "refused", "reason": str(e).splitlines()[0]}
    load_s = time.perf_counter() - t0
    load_read = sysprobe.proc_io()["read_bytes"]
    per, toks_all, wins = [], [], []
    for doc in spec["docs"]:  # one document after another, batch 1
        one = {**spec, **doc}
        sp = sampling_of(one)
        tl = sysprobe.Timeline()
        win = RoutingWindows()
        with llm.engine([(doc["prompt"], sp)]) as core:
            core.runner.observers.append(win)
            req = core.add(Request(prompt_ids=list(doc["prompt"]), params=sp))
            tl.start()
            n = 0
            while core.has_work:
                core.step()
                if len(req.output_ids) != n:
                    n = len(req.output_ids)
                    tl.mark(n)
                win.at(n)
            toks_all.append(list(req.output_ids))
        per.append(tl.summary(spec["window"]))
        wins.append(win.summary(len(toks_all[-1])))
    st = llm.stats
    keep = {k: v for k, v in st.items() if isinstance(v, (int, float, str, bool)) or v is None}
    for k in ("memory", "drafters", "controller_steps", "controller_rows_by_drafter", "step_breakdown"):
        if k in st:
            keep[k] = st[k]
    res = {"load_s": load_s, "load_read_bytes": load_read, "dtype": str(llm.dtype).removeprefix("torch."),
           "token_ids": toks_all, **sysprobe.combine(per), "routing_windows": RoutingWindows.combine(wins),
           "expert_memory_bytes": llm.expert_memory.total, "expert_memory_parts": llm.expert_memory.parts,
           "cache_slots_per_layer": llm.expert_memory.slots, "hit_rate": st.get("hit_rate"), "stats": keep,
           "status_at_end": sysprobe.proc_status(), "io_at_end": sysprobe.proc_io()}
    llm.close()
    return res


def child_main(argv: list[str]) -> int:
    """`python -m specmoe.bench.overram_runs SPEC_JSON`: run `child_specmoe`, print the tagged result line."""
    spec = json.loads(argv[0])
    res = child_specmoe(spec)
    if res.get("status") == "refused":
        print(f"refused: {res['reason']}", file=sys.stderr, flush=True)
    print(RESULT_TAG + json.dumps(res, default=str), flush=True)
    return 0


def run_child(argv: list[str], *, env: dict, files: dict[str, Path], device: str | None, log: Path,
              timeout: float, cgroup=None) -> dict:
    """Drop `files` from the page cache (their residency after the drop is recorded), run `argv` with `env`
    (stderr to `log`; inside `cgroup`, a live cgroup.MemCgroup, from before its exec), sample its memory while it
    runs, and return its result joined with the samples, the cgroup's counters, the device's bytes read over the
    run (every process on the device counts) and the files' residency after. Status: the child's ('ok', or
    'refused' with the engine's line), 'oom' when the kernel killed it for memory (cgroup.classify_exit), else
    'error' with the log's tail. An interrupt kills the child before it propagates."""
    from specmoe.bench.cgroup import classify_exit
    before = {k: sysprobe.drop_cache(f) for k, f in files.items()}
    d0 = sysprobe.disk_read_bytes(device)
    t0 = time.perf_counter()
    with open(log, "a") as errf:
        errf.write(f"\n==== {' '.join(argv[:3])} ... ({time.strftime('%H:%M:%S')})\n")
        errf.flush()
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=errf, env=env, text=True,
                                preexec_fn=cgroup.preexec if cgroup is not None else None)
        timed_out = False
        try:
            with sysprobe.Sampler(proc.pid) as smp:
                try:
                    out, _ = proc.communicate(timeout=timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    out, _ = proc.communicate()
                    timed_out = True
        except BaseException:
            proc.kill()
            proc.wait()
            raise
    wall = time.perf_counter() - t0
    d1 = sysprobe.disk_read_bytes(device)
    lines = [x for x in out.splitlines() if x.startswith(RESULT_TAG)]
    base = {"process_wall_s": wall, **smp.result(), "residency_before": before,
            "residency_after": {k: sysprobe.residency(f) for k, f in files.items()},
            "device_read_bytes": None if d0 is None or d1 is None else d1 - d0, "returncode": proc.returncode}
    if cgroup is not None:
        base["cgroup"] = {"name": cgroup.name, **cgroup.stats()}
    if timed_out:
        return {"status": "error", "reason": f"timed out after {timeout:.0f} s", **base}
    status = classify_exit(proc.returncode, base.get("cgroup"))
    if status == "oom":
        return {"status": "oom", "reason": f"killed by the kernel for memory (exit {proc.returncode}, cgroup failcnt "
                f"{base['cgroup']['failcnt']}, oom_kill {base['cgroup']['oom_control'].get('oom_kill')})", **base}
    if status != "ok" or not lines:
        tail = log.read_text()[-800:] if log.is_file() else ""
        return {"status": "error", "reason": f"exit status {proc.returncode}: {tail}", **base}
    got = json.loads(lines[-1][len(RESULT_TAG):])
    return {"status": got.pop("status", "ok"), **got, **base}


def llama_env(llama_site: str | None) -> dict:
    env = dict(os.environ)
    if llama_site:
        env["PYTHONPATH"] = os.pathsep.join([llama_site] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    return env


def llama_available(llama_site: str | None) -> str | None:
    """None when llama_cpp imports in a child with `llama_site` on its path, else why not."""
    proc = subprocess.run([sys.executable, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                          env=llama_env(llama_site), capture_output=True, text=True, timeout=120)
    if proc.returncode == 0:
        return None
    return "llama_cpp is not importable" + (f" with {llama_site} on PYTHONPATH" if llama_site else "") + \
        f": {(proc.stderr.strip().splitlines() or ['?'])[-1]}"


def llama_version(llama_site: str | None) -> str | None:
    """llama-cpp-python's version as a child with `llama_site` on its path imports it (None: not importable)."""
    proc = subprocess.run([sys.executable, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                          env=llama_env(llama_site), capture_output=True, text=True, timeout=120)
    return proc.stdout.strip() or None if proc.returncode == 0 else None


def llama_argv(spec: dict) -> list[str]:
    return [sys.executable, str(LLAMA_CHILD), json.dumps(spec)]


def specmoe_argv(spec: dict) -> list[str]:
    return [sys.executable, "-m", "specmoe.bench.overram_runs", json.dumps(spec)]


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
