"""The sweeps: systems × tiers × batch sizes, then γ / N / draft-policy / substitution
sweeps of SpecMoE, peers, the widened model; everything lands in one results dict.

Every point runs the same prompts (token ids), greedy, EOS ignored, the same cache size
and tier. A point that this build cannot run is recorded with its reason; a point that
failed, with its error; a point cut by the time budget, as skipped. No number is ever
filled in for one that did not run.
"""
from __future__ import annotations

import datetime as _dt
import gc
import json
import random
import sys
import time
import traceback
from dataclasses import asdict, fields, replace
from pathlib import Path

from tqdm import tqdm

from specmoe.bench import systems as S
from specmoe.bench.config import BenchConfig
from specmoe.bench.machine import _load, machine_info
from specmoe.bench.measure import jsonable, measure
from specmoe.bundled import prompts_dir
from specmoe.errors import SpecMoEError
from specmoe.experts.cache import ExpertCache

DOMAINS = ("code", "docs", "bible", "fortunes")
FALLBACK_PROMPTS = ("def fibonacci(n):", "The quick brown fox", "In the beginning", "Usage: specmoe generate")


# ---------------------------------------------------------------- inputs
def load_prompts(cfg: BenchConfig, tokenizer, vocab_size: int, n: int) -> tuple[list[list[int]], dict]:
    """`n` prompts as token ids, domains interleaved round-robin so every batch mixes them."""
    pdir = Path(cfg.prompts_dir) if cfg.prompts_dir else prompts_dir()
    per_domain: dict[str, list[str]] = {}
    for d in DOMAINS:
        f = pdir / f"{d}.jsonl"
        if f.is_file():
            per_domain[d] = [json.loads(line)["prompt"] for line in f.read_text().splitlines() if line.strip()]
    texts, info = [], {}
    if per_domain and tokenizer is not None:
        lists = list(per_domain.values())
        for i in range(max(len(x) for x in lists)):
            texts += [x[i] for x in lists if i < len(x)]
        info = {"source": str(pdir), "domains": {d: len(v) for d, v in per_domain.items()}}
    elif tokenizer is not None:
        texts = list(FALLBACK_PROMPTS)
        info = {"source": f"built-in fallback prompts ({pdir} has no prompt files)"}
    if texts:
        ids = [tokenizer.encode(t)[: cfg.prompt_tokens] for t in texts]
        ids = [p for p in ids if p]
    else:
        rng = random.Random(0)
        ids = [[rng.randrange(vocab_size) for _ in range(cfg.prompt_tokens)] for _ in range(8)]
        info = {"source": "synthetic seeded token ids (the checkpoint has no tokenizer)"}
    info.update(distinct=len(ids), prompt_tokens_max=cfg.prompt_tokens,
                note="batches larger than the number of distinct prompts reuse them cyclically")
    return [ids[i % len(ids)] for i in range(n)], info


def model_info(path: Path) -> dict:
    from specmoe.weights.checkpoint import Checkpoint, resolve_dtype
    ck = Checkpoint(path)
    c = ck.config
    esize = resolve_dtype(c.dtype).itemsize
    return {"path": str(path), "model_type": c.model_type, "hidden_size": c.hidden_size,
            "expert_intermediate_size": c.expert_intermediate_size, "num_layers": c.num_layers,
            "moe_layers": len(c.moe_layers), "num_experts": c.num_experts, "top_k": c.top_k, "dtype": c.dtype,
            "expert_bytes": c.expert_numel * esize,
            "all_expert_bytes": c.expert_numel * esize * c.num_experts * len(c.moe_layers)}


def build_options() -> dict:
    from specmoe.options import OffloadConfig, SpecConfig
    return {f.name: {"owner": cls.__name__, "default": jsonable(S.default(f.name)),
                     "choices": jsonable(f.metadata.get("choices")), "help": f.metadata.get("help")}
            for cls in (OffloadConfig, SpecConfig) for f in fields(cls)}


# ---------------------------------------------------------------- the run
class Bench:
    def __init__(self, cfg: BenchConfig, *, parent: "Bench | None" = None):
        self.cfg = cfg
        self.t0 = parent.t0 if parent else time.monotonic()
        self.deadline = parent.deadline if parent else (self.t0 + cfg.time_budget_s if cfg.time_budget_s else None)
        self.bar = parent.bar if parent else None
        # (model tag, batch, max_tokens) -> reference token ids
        self.refs: dict[tuple, list] = parent.refs if parent else {}

    def out_of_time(self, reserve_s: float | None = None) -> bool:
        """Past the budget; the sweeps stop `peer_reserve_s` early so the peers, run last, still fit."""
        if self.deadline is None:
            return False
        if reserve_s is None:
            reserve_s = self.cfg.peer_reserve_s if self.cfg.peers else 0.0
        return time.monotonic() > self.deadline - reserve_s

    def tick(self, desc: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(desc[:60])
            self.bar.update()

    def make_llm(self, path: Path, opts: dict, max_batch: int):
        from specmoe import LLM
        return LLM(path, dtype=self.cfg.dtype, device=self.cfg.device, max_batch=max_batch, **opts)

    def run_system(self, tag: str, path: Path, minfo: dict, setting: S.Setting, sys_: S.System,
                   batches, prompts, *, overrides: dict | None = None, sweep: str | None = None) -> list[dict]:
        """All batch sizes of one system at one setting, on one LLM instance."""
        cfg = self.cfg
        extra = dict(overrides or {})
        if sys_.kind != "reference":
            extra = {**cfg.extra_options, **extra}
            if setting.tier == "disk" and S.has_option("repack_dir") and "repack_dir" not in extra:
                extra["repack_dir"] = str(repack_dir(cfg, path))
        opts = S.system_options(sys_, setting, expert_bytes=minfo["expert_bytes"],
                                num_moe_layers=minfo["moe_layers"], overrides=extra)
        base = {"model": tag, "tier": "none" if sys_.kind == "reference" else setting.tier,
                "emulated": sys_.kind != "reference" and setting.emulated, "system": sys_.name,
                "label": sys_.label, "options": jsonable(opts)}
        if sweep:
            base["sweep"] = sweep
        rows = []

        def mark(status, reason, bs):
            for b in bs:
                rows.append({**base, "batch": b, "status": status, "reason": reason})
                self.tick(f"{sys_.name} b={b} {status}")

        reason = S.unavailable_reason(opts)
        if reason:
            mark("unavailable", reason, batches)
            return rows
        if self.out_of_time():
            mark("skipped", "time budget of the preset exhausted", batches)
            return rows
        try:
            llm = self.make_llm(path, opts, max(batches))
        except SpecMoEError as e:
            status = "unavailable" if "not available" in str(e) else "error"
            mark(status, f"{type(e).__name__}: {e}", batches)
            return rows
        except Exception as e:  # a build in progress may fail in ways we must record, not hide
            mark("error", f"{type(e).__name__}: {e}", batches)
            traceback.print_exc(file=sys.stderr)
            return rows
        base["effective_options"] = jsonable({**asdict(llm.offload_cfg), **asdict(llm.spec_cfg)})
        oracle = opts.get("prefetch") == "oracle"
        if oracle and not isinstance(llm.store, ExpertCache):
            mark("unavailable", "prefetch='oracle' needs an offloading expert cache", batches)
            return rows
        if oracle:
            base["note"] = "oracle prefetch: an identical run is recorded first, the replay is measured"
        try:
            try:  # warm-up: first-touch allocations, lazy init
                measure(llm, prompts[:2], 2, instrument=False)
            except Exception as e:
                mark("error", f"warm-up failed: {type(e).__name__}: {e}", batches)
                traceback.print_exc(file=sys.stderr)
                return rows
            for b in batches:
                if self.out_of_time():
                    mark("skipped", "time budget of the preset exhausted", [b])
                    continue
                ref = self.refs.get((tag, b, cfg.max_tokens))
                try:
                    if oracle:  # record this exact run, then measure its replay (cf. cache.start_oracle_replay)
                        llm = self._fresh(llm, path, opts, max(batches))
                        measure(llm, prompts[:b], cfg.max_tokens, instrument=False)
                    reps = []
                    # repeats where they are cheap; a large batch averages over many steps already
                    n_rep = max(1, cfg.repeats) if b * cfg.max_tokens <= cfg.repeat_below_tokens else 1
                    for _ in range(n_rep):
                        if oracle:
                            llm.store.start_oracle_replay()
                        cold(llm)
                        reps.append(measure(llm, prompts[:b], cfg.max_tokens, reference=ref,
                                            instrument=cfg.instrument))
                    # the fastest repeat (timeit's rule: slower ones measure the neighbours on a shared machine)
                    row = min(reps, key=lambda r: r["wall_s"])
                    row["repeats_wall_s"] = [r["wall_s"] for r in reps]
                except Exception as e:
                    mark("error", f"{type(e).__name__}: {e}", [b])
                    traceback.print_exc(file=sys.stderr)
                    continue
                ids = row.pop("_token_ids")
                if sys_.kind == "reference" and (tag, b, cfg.max_tokens) not in self.refs:
                    self.refs[(tag, b, cfg.max_tokens)] = ids
                rows.append({**base, "status": "ok", **row})
                self.tick(f"{tag} {setting.name} {sys_.name} b={b}")
        finally:
            del llm
            gc.collect()
        return rows

    def _fresh(self, llm, path, opts, max_batch):
        """A new LLM (oracle prefetch records per run: each batch size gets its own recording)."""
        del llm
        gc.collect()
        return self.make_llm(path, opts, max_batch)

    # ---------------------------------------------------------------- sections
    def settings(self, minfo: dict) -> list[S.Setting]:
        cache = max(1, round(self.cfg.cache_fraction * minfo["num_experts"]))
        out = []
        for t in self.cfg.tiers:
            if t == "host":
                out.append(S.Setting("host", cache, self.cfg.link_gbps, self.cfg.link_latency_us))
            else:
                out.append(S.Setting(t, cache))
        return out

    def main_sweep(self, tag, path, minfo, batches, prompts) -> list[dict]:
        rows = []
        ran_reference = False
        for setting in self.settings(minfo):
            names = (self.cfg.tier_systems or {}).get(setting.tier) or self.cfg.systems or tuple(s.name for s in S.SYSTEMS)
            # the reference first (its tokens check every other system: lossless output), then SpecMoE and
            # MoE-OnDemand, so a time budget that runs out cuts the least important baselines
            first = {"reference": 0, S.HEADLINE: 1, S.OFFLOADED_BASELINE: 2}
            chosen = sorted((S.system(n) for n in names), key=lambda s: first.get(s.kind, first.get(s.name, 3)))
            for sys_ in chosen:
                if sys_.kind == "reference":
                    if ran_reference:
                        continue  # tier-independent: run once
                    ran_reference = True
                rows += self.run_system(tag, path, minfo, setting, sys_, batches, prompts)
        return rows

    def spec_sweeps(self, tag, path, minfo, prompts) -> dict:
        cfg = self.cfg
        setting = next((s for s in self.settings(minfo) if s.tier == cfg.sweep_tier), self.settings(minfo)[0])
        spec = S.system(S.HEADLINE)
        out = {}
        plan = {"gamma": ("num_draft_tokens", cfg.gammas), "draft_experts": ("draft_experts", cfg.draft_experts)}
        if cfg.policies:
            plan["draft_policy"] = ("draft_policy", S.choices("draft_policy") or ())
        if cfg.substitutions:
            plan["substitution"] = ("substitution", S.choices("substitution") or ())
        plan = {k: v for k, v in plan.items() if v[1]}  # a preset may run none of them (`headline`)
        if not plan:
            return out
        if (tag, cfg.sweep_batch, cfg.max_tokens) not in self.refs and S.system("resident").name in (cfg.systems or ("resident",)):
            out["reference"] = {"rows": self.run_system(tag, path, minfo, setting, S.system("resident"),
                                                        [cfg.sweep_batch], prompts, sweep="reference")}
        for key, (opt, values) in plan.items():
            rows = []
            if not S.has_option(opt):
                out[key] = {"option": opt, "status": "unavailable", "reason": f"option {opt}= not available in this build",
                            "rows": []}
                self.tick(f"{key} unavailable")
                continue
            for v in values:
                new = self.run_system(tag, path, minfo, setting, spec, [cfg.sweep_batch], prompts,
                                      overrides={opt: v}, sweep=f"{key}={v}")
                rows += [{**r, "value": v} for r in new]
            out[key] = {"option": opt, "tier": setting.tier, "batch": cfg.sweep_batch, "rows": rows}
        return out


def cold(llm) -> None:
    """Every measured run starts from the same cache state: unpinned, non-static experts evicted."""
    llm.store.evict_all()


def best_batch(runs: list[dict], model: str = "main") -> int | None:
    """The batch where SpecMoE's tokens/s over MoE-OnDemand's (same tier) is highest in these rows."""
    rows = [r for r in headline(runs) if r["model"] == model and r["vs"] == S.OFFLOADED_BASELINE and r["speedup"]]
    return max(rows, key=lambda r: r["speedup"])["batch"] if rows else None


def count_points(cfg: BenchConfig, n_models: int) -> int:
    per_tier = [len((cfg.tier_systems or {}).get(t) or cfg.systems or S.SYSTEMS) for t in cfg.tiers]
    main = (sum(per_tier) - (len(per_tier) - 1)) * len(cfg.batch_sizes)
    sweeps = len(cfg.gammas) + len(cfg.draft_experts) + 8
    wide = len(cfg.widened_systems or cfg.systems or S.SYSTEMS) * len(cfg.widened_tiers or cfg.tiers)
    return main + sweeps + (wide * len(cfg.widened_batches) if n_models > 1 else 0)


def headline(runs: list[dict]) -> list[dict]:
    """SpecMoE vs every other system at each (model, tier, batch), from this run's own rows."""
    ok = [r for r in runs if r.get("status") == "ok" and "sweep" not in r]
    table = []
    for r in ok:
        if r["system"] != S.HEADLINE:
            continue
        for o in ok:
            if o["model"] != r["model"] or o["batch"] != r["batch"] or o["system"] == r["system"]:
                continue
            if o["tier"] not in (r["tier"], "none"):
                continue
            table.append({"model": r["model"], "tier": r["tier"], "emulated": r["emulated"], "batch": r["batch"],
                          "vs": o["system"], "vs_tier": o["tier"],
                          "tokens_per_s": r["tokens_per_s"], "vs_tokens_per_s": o["tokens_per_s"],
                          "speedup": r["tokens_per_s"] / o["tokens_per_s"] if o["tokens_per_s"] else None,
                          "bytes_per_token": r.get("bytes_per_token"), "vs_bytes_per_token": o.get("bytes_per_token"),
                          "decode_bytes_per_token": r.get("decode_bytes_per_token"),
                          "vs_decode_bytes_per_token": o.get("decode_bytes_per_token")})
    return table


def run_bench(cfg: BenchConfig, *, command: str | None = None) -> dict:
    """Run the configured benchmark; write results.json (+ PNGs) into cfg.out; return the results."""
    import torch
    from specmoe.engine.llm import default_model_path
    from specmoe.tokenizer import Tokenizer
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    path = Path(cfg.model) if cfg.model else default_model_path()
    minfo = model_info(path)
    bench = Bench(cfg)
    res = {"schema": 1, "created_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "command": command, "config": jsonable(asdict(cfg)), "machine": machine_info(path),
           "models": {"main": minfo}, "build_options": build_options(),
           "systems": [asdict(s) for s in S.SYSTEMS], "runs": [], "sweeps": {}, "peers": [], "notes": []}
    res["tiers"] = {s.tier: {"label": s.name, "emulated": s.emulated,
                             "link_gbps": s.link_gbps if s.emulated else None,
                             "link_latency_us": s.link_latency_us if s.emulated else None,
                             "cache_experts_per_layer": s.cache_experts} for s in bench.settings(minfo)}
    res["link_emulated"] = any(s.emulated for s in bench.settings(minfo))
    res["notes"] += [
        "tokens_per_s = generated tokens / wall time of llm.generate (prefill included); decode_tokens_per_s = "
        "tokens from decode steps / decode time (the first token of each sequence comes from the prefill)",
        "greedy, EOS ignored: every system generates exactly batch x max_tokens tokens; matches_reference = share "
        "of sequences whose tokens equal the all-resident autoregressive run",
        "every measured run starts from an evicted cache (pinned / static experts stay); with repeats > 1 the "
        "fastest run is reported and every wall time is kept in repeats_wall_s",
        "host-tier rows run behind an EMULATED link (link_gbps / link_latency_us); disk-tier rows are real reads",
        "bytes_per_token = all expert bytes moved (prefill included) / generated tokens; decode_bytes_per_token "
        "= bytes moved after the prefill / decode tokens (sampled at the first decode forward)",
        "breakdown: fetch wait and expert compute are timed around the expert store during decode (prefill "
        "excluded); draft phase = the strategy's draft_time_s (the draft reads its draft experts in place, where they "
        "are pinned in the cache's slots or resident, and fetches nothing); attention / other = the rest of the "
        "decode time",
    ]
    tok = Tokenizer.load(path)
    fixed_sweep = cfg.sweep_batch if isinstance(cfg.sweep_batch, int) else 0
    nmax = max([*cfg.batch_sizes, fixed_sweep, *cfg.peer_batches, *cfg.widened_batches])
    prompts, pinfo = load_prompts(cfg, tok, minfo_vocab(path), nmax)
    res["prompts"] = pinfo
    models = [("main", path, minfo)]
    if cfg.widened:
        from specmoe.bench.widen import widened_copy
        try:
            wpath, winfo = widened_copy(path, cache_dir=cache_dir(cfg), hidden=cfg.widened_hidden,
                                        expert_mb=cfg.widened_expert_mb, check_prompts=prompts[:4],
                                        progress=cfg.progress, device=cfg.device)
            models.append(("widened", wpath, {**model_info(wpath), "widen": winfo}))
            res["models"]["widened"] = models[-1][2]
        except Exception as e:
            res["models"]["widened"] = {"status": "error", "reason": f"{type(e).__name__}: {e}"}
    bench.bar = tqdm(total=count_points(cfg, len(models)), desc="bench", unit="pt", disable=not cfg.progress)
    try:
        res["runs"] += bench.main_sweep("main", path, minfo, cfg.batch_sizes, prompts)
        sweep_batch = cfg.sweep_batch
        if sweep_batch == "best":
            sweep_batch = best_batch(res["runs"]) or max(cfg.batch_sizes)
            res["notes"].append(f"sweeps at batch {sweep_batch}: where SpecMoE gained most over "
                                f"{S.OFFLOADED_BASELINE} in the main sweep")
        sweeps = Bench(replace(cfg, max_tokens=cfg.sweep_max_tokens or cfg.max_tokens, sweep_batch=sweep_batch),
                       parent=bench)
        res["sweeps"] = sweeps.spec_sweeps("main", path, minfo, prompts)
        for tag, wpath, winfo in models[1:]:
            wide = replace(cfg, systems=cfg.widened_systems or cfg.systems, tiers=cfg.widened_tiers or cfg.tiers,
                           max_tokens=cfg.widened_max_tokens or cfg.max_tokens, tier_systems=None)
            res["runs"] += Bench(wide, parent=bench).main_sweep(tag, wpath, winfo, cfg.widened_batches, prompts)
        if cfg.peers:
            from specmoe.bench.peers import run_peers
            res["peers"] = run_peers(cfg, path, prompts, out=out, refs=bench.refs, minfo=minfo,
                                     out_of_time=lambda: bench.out_of_time(0.0))
    finally:
        bench.bar.close()
        res["elapsed_s"] = time.monotonic() - bench.t0
        res["loadavg_at_end"] = _load()
        res["headline"] = headline(res["runs"])
        write(res, out)
    if cfg.plots:
        from specmoe.bench.plots import make_plots
        try:
            res["plots"] = make_plots(res, out)
        except Exception as e:
            res["plots"] = {"status": "error", "reason": f"{type(e).__name__}: {e}"}
        write(res, out)
    from specmoe.bench.report import make_report
    make_report(res, out)
    return res


def cache_dir(cfg: BenchConfig) -> Path:
    d = Path(cfg.cache_dir) if cfg.cache_dir else Path.home() / ".cache" / "specmoe"
    d.mkdir(parents=True, exist_ok=True)
    return d


def repack_dir(cfg: BenchConfig, path: Path) -> Path:
    """The bench's own disk-tier repack, keyed by the checkpoint's fingerprint: a repack shared with other
    processes can go stale under us when the checkpoint is re-exported."""
    import hashlib

    from specmoe.weights.checkpoint import Checkpoint
    tag = hashlib.sha1(Checkpoint(path).fingerprint().encode()).hexdigest()[:10]
    return cache_dir(cfg) / "repack" / f"{path.name}-{tag}"


def minfo_vocab(path: Path) -> int:
    from specmoe.families import load_config
    return load_config(path).vocab_size


def write(res: dict, out: Path) -> Path:
    f = out / "results.json"
    tmp = f.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(jsonable(res), indent=1))
    tmp.replace(f)
    return f
