"""`specmoe bench --control`: does `decoding="auto"` speculate exactly when it pays?

Three measurements, each from back-to-back runs of one invocation (ratios only):

1. *Systems and validation* (disk tier, demo and widened models, batch 1/4/16/64): the non-speculative
   systems (ondemand, static, lru, lfu, overlap), `auto`, and `auto` forced to plain steps (`auto-plain`:
   what its plain steps cost next to LRU's AR steps) and to speculation with the full γ (`auto-spec`). The
   controller records each step's predicted and measured time: median absolute error per (model, batch,
   kind), refined (as the controller used it) and raw (calibration only).
2. *φ sweep* (host tier behind the emulated link at several GB/s, demo model): measured φ = F / C of the best
   baseline (its fetch wait over the rest of its decode time); measured and predicted speedup of forced
   SpecMoE and of `auto` over the best baseline; the φ where speculation starts to pay.
3. *Steady state*: many more requests than batch slots (the scheduler keeps the batch full) beside the
   fixed batch, whose ragged tail runs nearly empty steps.

Results: `control.json` (+ `phi_sweep.png`) in the output directory; `control.md` is generated from it.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from specmoe.bench import systems as S
from specmoe.bench.config import BenchConfig
from specmoe.bench.machine import _load, machine_info
from specmoe.bench.measure import jsonable
from specmoe.bench.runner import Bench, cache_dir, load_prompts, minfo_vocab, model_info, repack_dir

BASELINES = ("ondemand", "static", "lru", "lfu", "overlap")
FORCED = {"auto-plain": "plain", "auto-spec": "spec"}
AUTO = S.System("auto", "SpecMoE auto (controller)", {"decoding": "auto"}, kind="speculative")
AUTO_PLAIN = S.System("auto-plain", "auto, forced plain steps", {"decoding": "auto"}, kind="speculative")
AUTO_SPEC = S.System("auto-spec", "auto, forced speculation (full γ)", {"decoding": "auto"}, kind="speculative")


@dataclass
class ControlConfig:
    out: str = "benchmarks/results"
    batches: tuple[int, ...] = (1, 4, 16, 64)
    max_tokens: int = 12
    widened: bool = True
    widened_batches: tuple[int, ...] = (1, 4, 16, 64)
    widened_max_tokens: int = 8
    phi_links: tuple[float, ...] = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0)
    phi_batch: int = 16
    phi_systems: tuple[str, ...] = ("ondemand", "lru", "overlap")
    steady_batch: int = 16
    steady_requests: int = 64
    threads: int = 1
    repeats: int = 2                  # measured runs per point, the fastest kept (a shared machine)
    progress: bool = True
    sections: tuple[str, ...] = ("systems", "plaincost", "phi", "steady")
    bench: dict = field(default_factory=dict)  # BenchConfig overrides (cache_fraction, prompt_tokens, ...)


class ControlBench(Bench):
    """A Bench whose `auto-plain` / `auto-spec` systems force the engine's controller; `slots` caps the batch
    (steady state: more requests than slots)."""
    force: str | None = None
    slots: int | None = None

    def make_llm(self, path, opts, max_batch):
        llm = super().make_llm(path, opts, self.slots or max_batch)
        if self.force is not None:
            from specmoe.engine.auto import controller_of
            ctl = controller_of(llm)
            ctl.force = self.force
            ctl.p_min = 0.0  # forced speculation = decoding="specmoe": every sequence drafts its full γ
        return llm

    def run(self, tag, path, minfo, setting, sys_, batches, prompts, **kw):
        self.force = FORCED.get(sys_.name)
        try:
            return self.run_system(tag, path, minfo, setting, sys_, batches, prompts, **kw)
        finally:
            self.force = None


def _sys(name: str) -> S.System:
    return {"auto": AUTO, "auto-plain": AUTO_PLAIN, "auto-spec": AUTO_SPEC}.get(name) or S.system(name)


def _slim(row: dict) -> dict:
    """A run row without its bulky per-expert tables; step predictions summarised."""
    st = row.get("stats", {})
    keep = {k: v for k, v in row.items() if k not in ("stats", "expert_counts", "expert_forwards")}
    for k in ("controller_steps", "controller_reasons", "controller_draft_stops", "acceptance_calibrated",
              "time_refinement", "fwd_refinement", "miss_refinement", "coefficients", "controller_s",
              "draft_set_unpins", "draft_prefetch_precision", "draft_prefetch_recall", "steps", "ar_steps",
              "step_breakdown"):
        if k in st:
            keep[k] = st[k]
    preds = st.get("step_predictions") or []
    if preds:
        keep["predictions"] = prediction_summary(preds)
    return keep


def prediction_summary(preds: list) -> dict:
    """Per kind: steps, median |predicted / measured - 1| (refined and raw), predicted tokens/s of plain and
    of the best speculative plan (means over the steps)."""
    out = {}
    for kind in ("plain", "spec"):
        p = [x for x in preds if x[0] == kind]
        if not p:
            continue
        a = np.array([x[2:5] for x in p], float)
        out[kind] = {"steps": len(p), "median_abs_err": float(np.median(np.abs(a[:, 0] / a[:, 2] - 1))),
                     "median_abs_err_raw": float(np.median(np.abs(a[:, 1] / a[:, 2] - 1))),
                     "measured_step_s": float(np.median(a[:, 2])), "predicted_step_s": float(np.median(a[:, 0]))}
    out["predicted_plain_tok_s"] = float(np.mean([x[5] for x in preds]))
    out["predicted_spec_tok_s"] = float(np.mean([x[6] for x in preds]))
    return out


def _phi(row: dict) -> float | None:
    b = row.get("breakdown") or {}
    f, d = b.get("fetch_wait_s"), b.get("decode_time_s")
    return f / (d - f) if f is not None and d and d > f else None


def best_baseline(rows: list[dict], model: str, tier: str, batch: int, names=BASELINES) -> dict | None:
    cands = [r for r in rows if r.get("status") == "ok" and r["model"] == model and r["tier"] == tier
             and r["batch"] == batch and r["system"] in names]
    return max(cands, key=lambda r: r["tokens_per_s"], default=None)


def systems_section(cb: ControlBench, cfg: ControlConfig, models, prompts) -> dict:
    rows = []
    for tag, path, minfo, batches, max_tokens in models:
        b = ControlBench(replace(cb.cfg, max_tokens=max_tokens), parent=cb)
        setting = next(s for s in b.settings(minfo) if s.tier == "disk")
        for name in ("resident", *BASELINES, "auto", "auto-plain", "auto-spec"):
            rows += [_slim(r) for r in b.run(tag, path, minfo, setting, _sys(name), batches, prompts)]
    table = []
    for tag, _, _, batches, _ in models:
        for B in batches:
            best = best_baseline(rows, tag, "disk", B)
            get = {r["system"]: r for r in rows if r.get("status") == "ok" and r["model"] == tag and r["batch"] == B
                   and r["tier"] == "disk"}
            if best is None:
                continue
            entry = {"model": tag, "batch": B, "best_baseline": best["system"],
                     "best_baseline_tok_s": best["tokens_per_s"], "phi": _phi(best)}
            for name in ("auto", "auto-plain", "auto-spec", "lru"):
                r = get.get(name)
                entry[f"{name}_tok_s"] = r and r["tokens_per_s"]
                entry[f"{name}_vs_best"] = r and r["tokens_per_s"] / best["tokens_per_s"]
            lru = get.get("lru")
            if lru and get.get("auto-plain"):
                entry["auto_plain_vs_lru"] = get["auto-plain"]["tokens_per_s"] / lru["tokens_per_s"]
                entry["auto_plain_step_vs_lru_step"] = (
                    (get["auto-plain"]["breakdown"]["decode_time_s"] / get["auto-plain"]["decode_steps"])
                    / (lru["breakdown"]["decode_time_s"] / lru["decode_steps"]))
            for name, kind in (("auto-plain", "plain"), ("auto-spec", "spec")):
                p = (get.get(name) or {}).get("predictions", {}).get(kind)
                if p:
                    entry[f"{kind}_step_median_abs_err"] = p["median_abs_err"]
                    entry[f"{kind}_step_median_abs_err_raw"] = p["median_abs_err_raw"]
            a = get.get("auto")
            if a:
                entry["auto_steps"] = a.get("controller_steps")
                entry["auto_matches_reference"] = a.get("matches_reference")
            table.append(entry)
    errs = [e[k] for e in table for k in ("plain_step_median_abs_err", "spec_step_median_abs_err") if e.get(k) is not None]
    return {"rows": rows, "table": table,
            "median_abs_err_all": float(np.median(errs)) if errs else None,
            "auto_min_vs_best": min((e["auto_vs_best"] for e in table if e.get("auto_vs_best")), default=None)}


def phi_section(cb: ControlBench, cfg: ControlConfig, path, minfo, prompts) -> dict:
    rows, table = [], []
    for gbps in cfg.phi_links:
        b = ControlBench(replace(cb.cfg, link_gbps=gbps), parent=cb)
        setting = next(s for s in b.settings(minfo) if s.tier == "host")
        got = []
        for name in (*cfg.phi_systems, "auto", "auto-spec"):
            got += [{**_slim(r), "link_gbps": gbps} for r in b.run("main", path, minfo, setting, _sys(name),
                                                                   [cfg.phi_batch], prompts)]
        rows += got
        best = best_baseline(got, "main", "host", cfg.phi_batch, cfg.phi_systems)
        if best is None:
            continue
        get = {r["system"]: r for r in got if r.get("status") == "ok"}
        entry = {"link_gbps": gbps, "best_baseline": best["system"], "best_baseline_tok_s": best["tokens_per_s"],
                 "phi": _phi(best)}
        for name in ("auto", "auto-spec"):
            r = get.get(name)
            entry[f"{name}_tok_s"] = r and r["tokens_per_s"]
            entry[f"{name}_speedup"] = r and r["tokens_per_s"] / best["tokens_per_s"]
        # predicted: the controller's mean predicted tokens/s of its best speculative plan over plain (LRU)
        p = (get.get("auto") or {}).get("predictions") or (get.get("auto-spec") or {}).get("predictions")
        if p:
            entry["predicted_spec_speedup"] = p["predicted_spec_tok_s"] / p["predicted_plain_tok_s"]
            entry["predicted_auto_speedup"] = max(1.0, entry["predicted_spec_speedup"])
        table.append(entry)
    return {"batch": cfg.phi_batch, "rows": rows, "table": table,
            "pays_from_phi_measured": crossing(table, "auto-spec_speedup"),
            "pays_from_phi_predicted": crossing(table, "predicted_spec_speedup")}


def crossing(table: list[dict], key: str) -> float | None:
    """The measured φ where `key` first reaches 1 (linear interpolation in log φ between neighbours)."""
    pts = sorted((e["phi"], e[key]) for e in table if e.get("phi") and e.get(key) is not None)
    for (p0, s0), (p1, s1) in zip(pts, pts[1:]):
        if s0 < 1 <= s1:
            t = (1 - s0) / (s1 - s0)
            return float(np.exp(np.log(p0) + t * (np.log(p1) - np.log(p0))))
    if pts and pts[0][1] >= 1:
        return pts[0][0]  # pays already at the smallest φ measured
    return None


def steady_section(cb: ControlBench, cfg: ControlConfig, path, minfo, prompts) -> dict:
    rows = []
    B, n = cfg.steady_batch, cfg.steady_requests
    setting = next(s for s in cb.settings(minfo) if s.tier == "disk")
    for name in ("lru", "auto-spec", "auto"):
        for mode, batch in (("fixed", B), ("steady", n)):
            sub = ControlBench(cb.cfg, parent=cb)
            sub.slots = B
            rows += [{**_slim(r), "mode": mode, "slots": B} for r in
                     sub.run("main", path, minfo, setting, _sys(name), [batch], prompts)]
    return {"slots": B, "requests": n, "rows": rows,
            "note": "steady: requests = 4x the batch slots (max_batch), so finished sequences are replaced "
                    "between steps; fixed: one batch of `slots` requests run to the end"}


def plain_cost_section(cb: ControlBench, cfg: ControlConfig, path, minfo, prompts, *, batch: int = 4,
                       rounds: int = 20) -> dict:
    """What auto's plain steps cost next to AR steps: LRU (decoding="ar") and auto forced to plain steps, same
    tier and cache, measured alternately (ABAB...) so both see the same machine; median per-step decode time."""
    from specmoe.bench.measure import measure
    from specmoe.bench.runner import cold
    setting = next(s for s in cb.settings(minfo) if s.tier == "disk")
    llms = {}
    for name in ("lru", "auto-plain"):
        cb.force = FORCED.get(name)
        opts = S.system_options(_sys(name), setting, expert_bytes=minfo["expert_bytes"],
                                num_moe_layers=minfo["moe_layers"],
                                overrides={"repack_dir": str(repack_dir(cb.cfg, path))})
        llms[name] = cb.make_llm(path, opts, batch)
        measure(llms[name], prompts[:2], 2, instrument=False)  # warm-up (and the controller's calibration)
    cb.force = None
    per_step: dict[str, list[float]] = {n: [] for n in llms}
    same_bytes = True
    for _ in range(rounds):
        got = {}
        for name, llm in llms.items():
            cold(llm)
            r = measure(llm, prompts[:batch], cfg.max_tokens, instrument=False)
            per_step[name].append(r["stats"]["decode_time_s"] / r["decode_steps"])
            got[name] = (r["stats"]["bytes_moved"], r["stats"]["hits"], r["stats"]["misses"])
        same_bytes &= got["lru"] == got["auto-plain"]
    med = {n: float(np.median(v)) for n, v in per_step.items()}
    paired = float(np.median(np.array(per_step["auto-plain"]) / np.array(per_step["lru"])))
    return {"batch": batch, "rounds": rounds, "median_step_s": med, "ratio": med["auto-plain"] / med["lru"],
            "paired_median_ratio": paired,
            "same_bytes_hits_misses": same_bytes, "step_s": per_step}


def run_control(cfg: ControlConfig, bench: BenchConfig | None = None, *, command: str | None = None) -> dict:
    import torch

    from specmoe.engine.llm import default_model_path
    from specmoe.tokenizer import Tokenizer
    torch.set_num_threads(cfg.threads)
    bcfg = replace(bench or BenchConfig(), out=cfg.out, threads=cfg.threads, progress=cfg.progress, peers=(),
                   repeats=cfg.repeats, instrument=True, time_budget_s=None, **cfg.bench)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    path = Path(bcfg.model) if bcfg.model else default_model_path()
    minfo = model_info(path)
    t0 = time.monotonic()
    cb = ControlBench(bcfg)
    tok = Tokenizer.load(path)
    nmax = max(*cfg.batches, cfg.phi_batch, cfg.steady_requests, *cfg.widened_batches)
    prompts, pinfo = load_prompts(bcfg, tok, minfo_vocab(path), nmax)
    res = {"schema": 1, "kind": "control", "command": command, "config": jsonable(cfg.__dict__),
           "bench_config": jsonable(bcfg.__dict__), "machine": machine_info(path), "prompts": pinfo,
           "models": {"main": minfo}}
    keys = {"systems": "systems", "plaincost": "plain_step_cost", "phi": "phi_sweep", "steady": "steady_state"}
    old = out / "control.json"
    if old.is_file() and set(cfg.sections) != set(keys):  # a partial run keeps the other sections' results
        prev = json.loads(old.read_text())
        res["section_commands"] = {}
        for sec, key in keys.items():
            if sec not in cfg.sections and key in prev:
                res[key] = prev[key]
                res["section_commands"][sec] = prev.get("section_commands", {}).get(sec, prev.get("command"))
        for k in ("plot", "models"):
            if k in prev and "phi" not in cfg.sections:
                res[k] = {**prev[k], **res[k]} if isinstance(prev[k], dict) else prev[k]
    models = [("main", path, minfo, cfg.batches, cfg.max_tokens)]
    if cfg.widened and "systems" in cfg.sections:
        from specmoe.bench.widen import widened_copy
        wpath, winfo = widened_copy(path, cache_dir=cache_dir(bcfg), hidden=bcfg.widened_hidden,
                                    expert_mb=bcfg.widened_expert_mb, check_prompts=prompts[:4],
                                    progress=cfg.progress, device=bcfg.device)
        res["models"]["widened"] = {**model_info(wpath), "widen": winfo}
        models.append(("widened", wpath, res["models"]["widened"], cfg.widened_batches, cfg.widened_max_tokens))
    from tqdm import tqdm
    cb.bar = tqdm(desc="control bench", unit="pt", disable=not cfg.progress)
    try:
        if "systems" in cfg.sections:
            res["systems"] = systems_section(cb, cfg, models, prompts)
            write(res, out)
        if "plaincost" in cfg.sections:
            res["plain_step_cost"] = plain_cost_section(cb, cfg, path, minfo, prompts)
            write(res, out)
        if "phi" in cfg.sections:
            res["phi_sweep"] = phi_section(cb, cfg, path, minfo, prompts)
            write(res, out)
        if "steady" in cfg.sections:
            res["steady_state"] = steady_section(cb, cfg, path, minfo, prompts)
    finally:
        cb.bar.close()
        res["elapsed_s"] = time.monotonic() - t0
        res["loadavg_at_end"] = _load()
        write(res, out)
    if "phi_sweep" in res:
        from specmoe.bench.plots import plot_or_skip
        res["plot"] = plot_or_skip(phi_plot, res, out) or None
        write(res, out)
    (out / "control.md").write_text(report(res))
    return res


def write(res: dict, out: Path) -> None:
    f = out / "control.json"
    tmp = f.with_suffix(".tmp")
    tmp.write_text(json.dumps(jsonable(res), indent=1))
    tmp.replace(f)


def phi_plot(res: dict, out: Path) -> str | None:
    from specmoe.bench.plots import _plt
    t = [e for e in res["phi_sweep"]["table"] if e.get("phi")]
    if not t:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    t = sorted(t, key=lambda e: e["phi"])
    phi = [e["phi"] for e in t]
    for key, label, style in (("auto-spec_speedup", "SpecMoE forced, measured", "o-"),
                              ("auto_speedup", "auto, measured", "s-"),
                              ("predicted_spec_speedup", "SpecMoE, predicted", "o--"),
                              ("predicted_auto_speedup", "auto, predicted", "s--")):
        pts = [(p, e[key]) for p, e in zip(phi, t) if e.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), style, label=label)
    for p, e in zip(phi, t):
        ax.annotate(f"{e['link_gbps']:g} GB/s", (p, e.get("auto-spec_speedup") or 1), fontsize=7,
                    textcoords="offset points", xytext=(3, 4))
    ax.axhline(1.0, color="grey", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("measured φ = fetch wait / other decode time of the best baseline")
    ax.set_ylabel("tokens/s ÷ best baseline")
    ax.set_title(f"When speculation pays: demo model, batch {res['phi_sweep']['batch']}, "
                 "host tier [emulated link]", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    name = "phi_sweep.png"
    fig.savefig(out / name, dpi=120)
    plt.close(fig)
    return name


def _f(x, fmt="{:.2f}"):
    return "–" if x is None else fmt.format(x)


def report(res: dict) -> str:
    """control.md: every figure read from control.json."""
    lines = ["# When to speculate: `decoding=\"auto\"` against the baselines", "",
             f"Command: `{res.get('command')}`, at commit "
             f"`{(res['machine'].get('git_commit') or 'not recorded')[:10]}`"
             f"{' with uncommitted changes to specmoe/' if res['machine'].get('git_dirty') else ''} (the figures "
             f"describe the code there); {res['machine'].get('cpu_model')}, load average at start "
             f"{res['machine'].get('loadavg_at_start')}, at end {res.get('loadavg_at_end')} (a shared machine: "
             f"ratios of back-to-back runs); {res.get('elapsed_s', 0):.0f} s.", ""]
    for sec, cmd in (res.get("section_commands") or {}).items():
        lines += [f"Section {sec} is from an earlier run: `{cmd}`."]
    if res.get("section_commands"):
        lines.append("")
    sy = res.get("systems")
    if sy:
        lines += ["## Systems (disk tier) and step-time prediction", "",
                  f"Median absolute error of predicted vs measured step time over every (model, batch, kind): "
                  f"{_f(sy.get('median_abs_err_all'), '{:.0%}')}; lowest auto ÷ best baseline: "
                  f"{_f(sy.get('auto_min_vs_best'))}.", "",
                  "| model | batch | best baseline | its tok/s | φ | auto ÷ best | auto steps (plain/spec) | "
                  "forced spec ÷ best | auto-plain ÷ lru (tok/s) | plain step err (raw) | spec step err (raw) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]
        for e in sy["table"]:
            steps = e.get("auto_steps") or {}
            lines.append(
                f"| {e['model']} | {e['batch']} | {e['best_baseline']} | {_f(e['best_baseline_tok_s'], '{:.1f}')} | "
                f"{_f(e.get('phi'))} | {_f(e.get('auto_vs_best'))} | {steps.get('plain', '–')}/{steps.get('spec', '–')} | "
                f"{_f(e.get('auto-spec_vs_best'))} | {_f(e.get('auto_plain_vs_lru'))} | "
                f"{_f(e.get('plain_step_median_abs_err'), '{:.0%}')} ({_f(e.get('plain_step_median_abs_err_raw'), '{:.0%}')}) | "
                f"{_f(e.get('spec_step_median_abs_err'), '{:.0%}')} ({_f(e.get('spec_step_median_abs_err_raw'), '{:.0%}')}) |")
        lines.append("")
    pc = res.get("plain_step_cost")
    if pc:
        lines += ["## What auto's plain steps cost", "",
                  f"LRU (plain AR) and `auto` forced to plain steps, same tier and cache, batch {pc['batch']}, "
                  f"{pc['rounds']} alternating rounds: median decode time per step "
                  f"{pc['median_step_s']['lru'] * 1e3:.2f} ms vs {pc['median_step_s']['auto-plain'] * 1e3:.2f} ms "
                  f"(auto ÷ AR = {pc['ratio']:.3f}; median of the per-round ratios "
                  f"{pc.get('paired_median_ratio', pc['ratio']):.3f}); identical expert bytes, hits and misses in "
                  "every round: "
                  f"{'yes' if pc['same_bytes_hits_misses'] else 'no'}.", ""]
    ph = res.get("phi_sweep")
    if ph:
        lines += [f"## φ sweep (demo model, host tier behind the EMULATED link, batch {ph['batch']})", "",
                  f"Speculation starts to pay at measured φ ≈ {_f(ph.get('pays_from_phi_measured'))} "
                  f"(predicted: {_f(ph.get('pays_from_phi_predicted'))}).", "",
                  "| link GB/s | best baseline | φ | SpecMoE forced ÷ best | auto ÷ best | predicted SpecMoE ÷ plain |",
                  "|---|---|---|---|---|---|"]
        for e in ph["table"]:
            lines.append(f"| {e['link_gbps']:g} | {e['best_baseline']} | {_f(e.get('phi'))} | "
                         f"{_f(e.get('auto-spec_speedup'))} | {_f(e.get('auto_speedup'))} | "
                         f"{_f(e.get('predicted_spec_speedup'))} |")
        if res.get("plot"):
            lines += ["", f"![φ sweep]({res['plot']})"]
        lines.append("")
    ss = res.get("steady_state")
    if ss:
        lines += [f"## Steady state vs fixed batch (demo model, disk tier, {ss['slots']} slots)", "", ss["note"], "",
                  "| system | mode | requests | tok/s | decode steps | τ |", "|---|---|---|---|---|---|"]
        for r in ss["rows"]:
            if r.get("status") != "ok":
                lines.append(f"| {r['system']} | {r['mode']} | {r['batch']} | {r['status']} | | |")
                continue
            lines.append(f"| {r['system']} | {r['mode']} | {r['batch']} | {_f(r['tokens_per_s'], '{:.1f}')} | "
                         f"{r.get('decode_steps')} | {_f(r.get('tokens_per_step') or None)} |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    """`python -m specmoe.bench.auto_control [--report]`: rewrite control.md from control.json."""
    import argparse
    p = argparse.ArgumentParser(prog="python -m specmoe.bench.auto_control", description=main.__doc__)
    p.add_argument("--results", default=str(Path(__file__).resolve().parents[2] / "benchmarks" / "results"
                                            / "control.json"))
    a = p.parse_args(argv)
    res = json.loads(Path(a.results).read_text())
    (Path(a.results).parent / "control.md").write_text(report(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
