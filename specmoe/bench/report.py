"""results.json → a markdown report (README.md next to it): headline table, sweeps, peers,
what did not run and why, plots, the command and the machine. Every number is copied from
the results; nothing is computed that the rows do not hold, except ratios of two rows."""
from __future__ import annotations

from pathlib import Path


def _f(x, fmt="{:.1f}"):
    return "–" if x is None else fmt.format(x)


def _bytes(x):
    if x is None:
        return "–"
    for unit, k in (("MB", 1e6), ("KB", 1e3)):
        if x >= k:
            return f"{x / k:.1f} {unit}"
    return f"{x:.0f} B"


def _ok(rows):
    return [r for r in rows if r.get("status") == "ok"]


def headline_tables(res: dict) -> list[str]:
    out = []
    runs = [r for r in _ok(res["runs"]) if "sweep" not in r]
    for model in sorted({r["model"] for r in runs}):
        ref = {r["batch"]: r for r in runs if r["model"] == model and r["system"] == "resident"}
        for tier in [t for t in res.get("tiers", {}) if any(r["tier"] == t and r["model"] == model for r in runs)]:
            rows = [r for r in runs if r["model"] == model and r["tier"] == tier]
            others = [s["name"] for s in res["systems"] if s["name"] != "specmoe" and any(r["system"] == s["name"]
                                                                                           for r in rows)]
            batches = sorted({r["batch"] for r in rows})
            get = {(r["system"], r["batch"]): r for r in rows}
            t = res["tiers"][tier]
            title = f"{model} model — tier **{t['label']}**"
            if t.get("emulated"):
                title += f" (EMULATED link: {t['link_gbps']} GB/s, {t['link_latency_us']} µs per transfer)"
            out += [f"#### {title}", "",
                    "SpecMoE tokens/s (generated / wall incl. prefill) and its speedup over each system at the same "
                    "batch; expert bytes moved per decoded token (prefill excluded) in brackets (SpecMoE vs the other).", ""]
            head = ["batch", "SpecMoE tok/s", "SpecMoE decode bytes/tok"] + [f"vs {o}" for o in others] + ["vs resident"]
            out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
            for b in batches:
                sp = get.get(("specmoe", b))
                cells = [str(b), _f(sp and sp["tokens_per_s"]), _bytes(sp and sp.get("decode_bytes_per_token"))]
                for o in others + ["resident"]:
                    r = get.get((o, b)) if o != "resident" else ref.get(b)
                    if sp is None or r is None or not r.get("tokens_per_s"):
                        cells.append("–")
                        continue
                    c = f"{sp['tokens_per_s'] / r['tokens_per_s']:.2f}×"
                    if o != "resident":
                        c += f" ({_bytes(sp.get('decode_bytes_per_token'))} vs {_bytes(r.get('decode_bytes_per_token'))})"
                    cells.append(c)
                out.append("| " + " | ".join(cells) + " |")
            out += ["", "All systems at this tier:", "",
                    "| system | batch | tok/s | decode tok/s | bytes/tok (incl. prefill) | decode bytes/tok | hit rate | τ "
                    "| lossless vs resident |",
                    "|---|---|---|---|---|---|---|---|---|"]
            for r in sorted(rows + list(ref.values()), key=lambda r: (r["system"] != "resident", r["system"], r["batch"])):
                out.append(f"| {r['system']} | {r['batch']} | {_f(r['tokens_per_s'])} | {_f(r.get('decode_tokens_per_s'))}"
                           f" | {_bytes(r.get('bytes_per_token'))} | {_bytes(r.get('decode_bytes_per_token'))}"
                           f" | {_f(r.get('hit_rate'), '{:.2f}')} | "
                           f"{_f(r.get('tokens_per_step'), '{:.2f}')} | "
                           f"{_f(r.get('matches_reference'), '{:.0%}') if r['system'] != 'resident' else 'reference'} |")
            out.append("")
    return out


def sweep_tables(res: dict) -> list[str]:
    out = []
    titles = {"gamma": "τ vs γ (num_draft_tokens)", "draft_experts": "Draft experts N",
              "draft_policy": "Draft-set policy (cf. SpecMoE Table II)", "substitution": "Substitution mode"}
    for key, title in titles.items():
        sw = res.get("sweeps", {}).get(key)
        if not sw:
            continue
        out += [f"#### {title}", ""]
        if sw.get("status") == "unavailable":
            out += [f"Not available in this build: {sw['reason']}", ""]
            continue
        out += [f"SpecMoE, batch {sw.get('batch')}, tier {sw.get('tier')}.", "",
                f"| {sw['option']} | τ | tok/s | decode bytes/tok | acceptance per position | status |",
                "|---|---|---|---|---|---|"]
        for r in sw["rows"]:
            acc = r.get("acceptance_per_position")
            acc = ", ".join(f"{a:.2f}" for a in acc) if acc else "–"
            st = "ok" if r["status"] == "ok" else f"{r['status']}: {r.get('reason', '')}"
            out.append(f"| {r.get('value')} | {_f(r.get('tokens_per_step'), '{:.2f}')} | {_f(r.get('tokens_per_s'))} | "
                       f"{_bytes(r.get('decode_bytes_per_token'))} | {acc} | {st} |")
        out.append("")
    return out


def peer_table(res: dict) -> list[str]:
    """Peers against specmoe rows of the same run (peers carry no `run`: they belong to run 1)."""
    peers = res.get("peers", [])
    if not peers:
        return []
    runs = [r for r in _ok(res["runs"]) if "sweep" not in r and r["model"] == "main" and r.get("run", 1) == 1]

    def pick(system, b):
        for tier in ("disk", "host", "none"):
            r = next((r for r in runs if r["system"] == system and r["tier"] == tier and r["batch"] == b), None)
            if r is not None:
                return r
        return None

    out = ["Ratios divide rows of the same run; > 1 means the specmoe engine is faster than the peer.", "",
           "| peer | batch | tok/s | decode tok/s | SpecMoE ÷ peer | specmoe engine, all resident ÷ peer | status |",
           "|---|---|---|---|---|---|---|"]
    for p in peers:
        b = p.get("batch")
        cells = []
        for system in ("specmoe", "resident"):
            r = pick(system, b)
            cells.append(f"{r['tokens_per_s'] / p['tokens_per_s']:.2f}× ({r['tier']}{', EMULATED' if r.get('emulated') else ''})"
                         if r and p.get("tokens_per_s") else "–")
        st = "ok" if p["status"] == "ok" else f"{p['status']}: {p.get('reason', '')}"
        out.append(f"| {p['label']} | {b if b is not None else '–'} | {_f(p.get('tokens_per_s'))} | "
                   f"{_f(p.get('decode_tokens_per_s'))} | {cells[0]} | {cells[1]} | {st} |")
    return out + [""]


def not_run(res: dict) -> list[str]:
    seen, out = set(), []
    for r in res["runs"] + [r for sw in res.get("sweeps", {}).values() for r in sw.get("rows", [])]:
        if r.get("status") in (None, "ok"):
            continue
        key = (r.get("model"), r.get("tier"), r.get("system"), r.get("sweep"), r["status"], r.get("reason"))
        if key in seen:
            continue
        seen.add(key)
        out.append(f"- {r.get('model')} / {r.get('tier')} / {r.get('system')}{' / ' + r['sweep'] if r.get('sweep') else ''}:"
                   f" **{r['status']}** — {r.get('reason')}")
    return out


def make_report(res: dict, out: str | Path, *, preamble: str = "") -> Path:
    out = Path(out)
    m = res["machine"]
    lines = ["# specmoe bench results", ""]
    if preamble:
        lines += [preamble, ""]
    cmds = [m["command"] for m in res.get("merged_from", [])] or [res.get("command")]
    lines += ["## Command", "", "```"] + [c or "(library call: specmoe.bench.run_bench)" for c in cmds] + ["```", "",
              f"Preset `{res['config']['preset']}`, {res['created_utc']}, {res.get('elapsed_s', 0):.0f} s. "
              f"Greedy, EOS ignored ({res['config']['max_tokens']} tokens per sequence), prompts truncated to "
              f"{res['config']['prompt_tokens']} tokens from `{res['prompts'].get('source')}`; expert cache "
              f"{res['config']['cache_fraction']:.0%} of each layer's experts; every measured run starts from an "
              "evicted cache; torch threads "
              f"{res['config'].get('threads')}.", "", "## Machine", "",
              f"- CPU: {m.get('cpu_model')} — {m.get('logical_cores')} logical cores ({m.get('usable_cores')} usable), "
              f"RAM {m.get('ram_gib')} GiB; load average at start {m.get('loadavg_at_start')}, at end "
              f"{res.get('loadavg_at_end')} (the machine is shared)",
              f"- disk holding the model: {m.get('model_disk')}",
              f"- torch {m.get('torch')}, transformers {m.get('transformers')}, accelerate {m.get('accelerate')}, "
              f"llama-cpp-python {m.get('llama_cpp')}; git {m.get('git_commit')}",
              f"- emulated link used: {'yes — host-tier rows are EMULATED' if res.get('link_emulated') else 'no'}", ""]
    for tag, mi in res.get("models", {}).items():
        if mi.get("status") == "error":
            lines.append(f"- model `{tag}`: not built — {mi['reason']}")
        else:
            lines.append(f"- model `{tag}`: {mi.get('path')} — D={mi.get('hidden_size')}, I={mi.get('expert_intermediate_size')},"
                         f" {mi.get('moe_layers')} MoE layers × {mi.get('num_experts')} experts, top-{mi.get('top_k')},"
                         f" {_bytes(mi.get('expert_bytes'))} per expert, {_bytes(mi.get('all_expert_bytes'))} of experts")
            if mi.get("widen"):
                w = mi["widen"]
                lines.append(f"  - widened from {w['source']}: hidden {w['hidden']}, expert width {w['expert_intermediate']},"
                             f" eps {w['rms_norm_eps']}; greedy check: {w.get('greedy_check')}")
    if res.get("notes"):
        lines += ["", "## How the numbers are measured", ""] + [f"- {n}" for n in res["notes"]]
    lines += ["", "## Headline: SpecMoE vs each baseline", ""] + headline_tables(res)
    lines += ["## SpecMoE sweeps", ""] + sweep_tables(res)
    lines += ["## Peers (same model, prompts and token counts)", ""] + peer_table(res)
    nr = not_run(res)
    if nr:
        lines += ["## What did not run, and why", ""] + nr + [""]
    plots = res.get("plots") or {}
    if isinstance(plots, dict) and plots and "status" not in plots:
        lines += ["## Plots", ""] + [f"![{k}]({v})" for k, v in plots.items()] + [""]
    f = out / "README.md"
    f.write_text("\n".join(lines) + "\n")
    return f
