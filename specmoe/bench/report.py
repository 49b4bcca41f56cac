"""results.json → a markdown report (README.md next to it): headline table, sweeps, peers,
what did not run and why, plots, the command and the machine. Every number is copied from
the results; nothing is computed that the rows do not hold, except ratios of two rows."""
from __future__ import annotations

from pathlib import Path

from specmoe.bench.results_index import INDEX_DOC, replace_index, results_index


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
    """Write `out`/README.md (the report of `res`); returns its path."""
    f = Path(out) / "README.md"
    f.write_text(report_text(res, preamble=preamble))
    return f


def report_text(res: dict, *, preamble: str = "") -> str:
    m = res["machine"]
    lines = ["# specmoe bench results", ""]
    if preamble:
        lines += [preamble.strip(), ""]
    summary = summary_lines(res)
    if summary:
        lines += ["## What the numbers say", ""] + summary + [""]
    cmds = [m["command"] for m in res.get("merged_from", [])] or [res.get("command")]
    runs = "".join(f" Run {m.get('run')}: {m.get('elapsed_s', 0):.0f} s, {_at_commit(m)}."
                   for m in res.get("merged_from", []))
    lines += ["## Command", "", "```"] + [c or "(library call: specmoe.bench.run_bench)" for c in cmds] + ["```", "",
              f"Preset `{res['config']['preset']}`, {res['created_utc']}, {res.get('elapsed_s', 0):.0f} s.{runs} "
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
              f"llama-cpp-python {m.get('llama_cpp')}; git {m.get('git_commit')}"
              + (" with uncommitted changes to specmoe/" if m.get("git_dirty") else ""),
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
        lines += ["", "## How the numbers are measured", "",
                  "Notes recorded with the run; they describe the code at its commit (under Machine)."
                  if len(provenance(res)) == 1 else
                  "Notes recorded with the runs; they describe the code at the runs' commits (under Command).", ""]
        lines += [f"- {n}" for n in res["notes"]]
    lines += ["", "## Headline: SpecMoE vs each baseline", ""] + headline_tables(res)
    lines += ["## SpecMoE sweeps", ""] + sweep_tables(res)
    lines += ["## Peers (same model, prompts and token counts)", ""] + peer_table(res)
    nr = not_run(res)
    if nr:
        lines += ["## What did not run, and why", ""] + nr + [""]
    plots = res.get("plots") or {}
    if isinstance(plots, dict) and plots and "status" not in plots:
        lines += ["## Plots", ""] + [f"![{k}]({v})" for k, v in plots.items()] + [""]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- summary and the README's Results block
# Every figure below is read from results.json (or is a ratio of two of its rows); the README's Results
# block is this text verbatim (tests/test_readme.py), so no figure in it is typed by hand.
README = Path(__file__).resolve().parents[2] / "README.md"
RESULTS = README.parent / "benchmarks" / "results" / "results.json"
BEGIN = "<!-- results:begin (generated by `python -m specmoe.bench.report` from benchmarks/results/results.json) -->"
END = "<!-- results:end -->"
HEADLINE_BASELINES = ("ondemand", "static", "lru", "overlap")


def _span(values, fmt) -> str:
    """'a–b' over the values (one figure when both ends print the same)."""
    lo, hi = fmt(min(values)), fmt(max(values))
    return lo if lo == hi else f"{lo}–{hi}"


def _batch_list(bs, every) -> str:
    """Batch sizes as 'a–b' when they are a contiguous stretch of the measured sizes, else 'a, b, c'."""
    bs, every = sorted(bs), sorted(every)
    i = every.index(bs[0]) if bs and bs[0] in every else -1
    if len(bs) > 2 and every[i:i + len(bs)] == bs:
        return f"{bs[0]}–{bs[-1]}"
    return ", ".join(map(str, bs))


def _label(res, name) -> str:
    return next((s["label"] for s in res.get("systems", []) if s["name"] == name), name)


def _pairs(res, model, tier, other):
    """[(batch, specmoe row, other row)] at one model and tier, both rows ok and from the same run."""
    rows = [r for r in _ok(res["runs"]) if "sweep" not in r and r["model"] == model and r["tier"] == tier]
    get = {(r["system"], r["batch"]): r for r in rows}
    return [(b, sp, get[(other, b)]) for (s, b), sp in sorted(get.items(), key=lambda kv: kv[0][1])
            if s == "specmoe" and (other, b) in get and get[(other, b)].get("run", 1) == sp.get("run", 1)]


def _headline_tier(res, model="main"):
    tiers = [t for t in res.get("tiers", {}) if _pairs(res, model, t, "ondemand")]
    return "disk" if "disk" in tiers else (tiers[0] if tiers else None)


def _resident(res, model, b):
    return next((r for r in _ok(res["runs"]) if "sweep" not in r and r["model"] == model and r["system"] == "resident"
                 and r["tier"] == "none" and r["batch"] == b and r.get("run", 1) == 1), None)


def _pct(x):
    return f"{x:.0%}"


def _x(x):
    return f"{x:.2f}×"


def _speed_sentence(pairs, who) -> str:
    ratios = {b: sp["tokens_per_s"] / o["tokens_per_s"] for b, sp, o in pairs if o.get("tokens_per_s")}
    every = list(ratios)
    if not ratios:
        return ""
    if max(ratios.values()) < 1:
        return f"It is slower than {who} at every batch size: {_span(ratios.values(), _x)} its tokens/s."
    if min(ratios.values()) >= 1:
        return f"It is faster than {who} at every batch size: {_span(ratios.values(), _x)} its tokens/s."
    win = [b for b, v in ratios.items() if v >= 1]
    return (f"Against {who} it ranges from {_x(min(ratios.values()))} to {_x(max(ratios.values()))} its tokens/s: "
            f"faster at batch {_batch_list(win, every)}, slower at batch "
            f"{_batch_list([b for b in every if b not in win], every)}.")


def summary_lines(res: dict) -> list[str]:
    """What the results say, as markdown bullets; a bullet whose rows are missing is left out."""
    out, models = [], res.get("models", {})
    tier = _headline_tier(res)
    pairs = _pairs(res, "main", tier, "ondemand") if tier else []
    od = _label(res, "ondemand")
    if pairs:
        cut = [1 - sp["decode_bytes_per_token"] / o["decode_bytes_per_token"] for _, sp, o in pairs
               if o.get("decode_bytes_per_token") and sp.get("decode_bytes_per_token") is not None]
        taus = [sp["tokens_per_step"] for _, sp, _ in pairs if sp.get("tokens_per_step")]
        opts = pairs[0][1].get("effective_options", {})
        name = "Main model" if res.get("config", {}).get("model") else "Demo model"
        line = f"- {name}, {tier} tier: drafting moves no expert bytes"
        if cut:
            line += (f", and SpecMoE moves {_span(cut, _pct)} fewer expert bytes per decoded token than {od} "
                     f"(batch {_batch_list([b for b, _, _ in pairs], [b for b, _, _ in pairs])})")
        line += ". " + _speed_sentence(pairs, od)
        if taus and models.get("main", {}).get("expert_bytes"):
            line += (f" Each step pays γ={opts.get('num_draft_tokens')} draft forwards of the whole non-expert model "
                     f"and keeps τ = {_span(taus, '{:.1f}'.format)} tokens per step (N={opts.get('draft_experts')} "
                     f"draft experts of {models['main'].get('num_experts')}), while one expert is only "
                     f"{_bytes(models['main']['expert_bytes'])}.")
        out.append(line)
    wtier = _headline_tier(res, "widened")
    wpairs = _pairs(res, "widened", wtier, "ondemand") if wtier else []
    if wpairs:
        line = f"- Widened model ({_bytes(models.get('widened', {}).get('expert_bytes'))} per expert), {wtier} tier"
        waits = [o["breakdown"]["fetch_wait_s"] / o["breakdown"]["decode_time_s"] for _, _, o in wpairs
                 if o.get("breakdown", {}).get("decode_time_s")]
        if waits:
            line += f": fetch wait is {_span(waits, _pct)} of {od}'s decode time"
        out.append(line + ". " + _speed_sentence(wpairs, od))
    if pairs:
        match = {b: sp.get("matches_reference") for b, sp, _ in pairs if sp.get("matches_reference") is not None}
        every = sorted(match)
        same = [b for b in every if match[b] == 1]
        less = [b for b in every if match[b] < 1]
        dtype = models.get("main", {}).get("dtype", res.get("config", {}).get("dtype"))
        parts = []
        if same:
            parts.append(f"100% of sequences at batch {_batch_list(same, every)}")
        if less:
            parts.append(f"{_span([match[b] for b in less], _pct)} at batch {_batch_list(less, every)}")
        if parts:
            out.append(f"- Greedy equality ({dtype}, {tier} tier): SpecMoE's tokens equal the all-resident "
                       f"autoregressive run's for {' and for '.join(parts)}.")
    peers = [p for p in res.get("peers", []) if p.get("status") == "ok" and p.get("tokens_per_s")]
    by_peer: dict[str, list[dict]] = {}
    for p in peers:
        by_peer.setdefault(p["peer"], []).append(p)
    best = max(by_peer.values(), key=lambda ps: max(p["tokens_per_s"] for p in ps), default=[])
    ratios = [p["tokens_per_s"] / r["tokens_per_s"] for p in best if (r := _resident(res, "main", p["batch"]))]
    if ratios:
        out.append(f"- Peers: {best[0]['label']} runs {_span(ratios, '{:.1f}×'.format)} the tokens/s of the specmoe "
                   f"engine with every expert resident (batch {', '.join(str(p['batch']) for p in best)}).")
    return out


def provenance(res: dict) -> list[dict]:
    """The runs `res` holds (one, or each run of a merge): command, commit, whether specmoe/ had uncommitted
    changes, date."""
    m = res.get("machine", {})
    return res.get("merged_from") or [{"command": res.get("command"), "git_commit": m.get("git_commit"),
                                       "git_dirty": m.get("git_dirty"), "created_utc": res.get("created_utc")}]


def _at_commit(run: dict) -> str:
    c = run.get("git_commit")
    if not c:
        return "at an unrecorded commit"
    return f"at commit `{c[:10]}`" + (" with uncommitted changes to specmoe/" if run.get("git_dirty") else "")


def commit_sentence(res: dict) -> str:
    """What the figures describe: the code at the recorded commit(s)."""
    commits = {r.get("git_commit") for r in provenance(res) if r.get("git_commit")}
    if not commits:
        return "The commit of the code they measure was not recorded."
    return f"They describe the code at {'that commit' if len(commits) == 1 else 'those commits'}, not necessarily yours."


def stale_code(res: dict, repo: Path = README.parent) -> list[str]:
    """The recorded commits whose specmoe/ tree differs from HEAD's (empty when git cannot tell)."""
    import subprocess

    def tree(rev):
        try:
            out = subprocess.run(["git", "rev-parse", f"{rev}:specmoe"], cwd=repo, capture_output=True, text=True,
                                 timeout=5)
        except (OSError, subprocess.SubprocessError):
            return None
        return out.stdout.strip() if out.returncode == 0 else None
    head = tree("HEAD")
    commits = {r.get("git_commit") for r in provenance(res) if r.get("git_commit")}
    return sorted(c for c in commits if head and tree(c) != head)


def readme_block(res: dict) -> str:
    """The README's Results block, markers included."""
    m, cfg, models = res["machine"], res.get("config", {}), res.get("models", {})
    measured = " and ".join(f"`{r['command']}` {_at_commit(r)}" for r in provenance(res) if r.get("command"))
    lines = [BEGIN,
             f"Measured with {measured} ({res.get('created_utc', '')[:10]}) on "
             f"{m.get('cpu_model')} ({m.get('logical_cores')} logical cores, {', '.join(m.get('cpu_flags') or [])}, "
             f"{m.get('ram_gib')} GiB RAM), torch {m.get('torch')}, {cfg.get('threads')} torch thread"
             f"{'' if cfg.get('threads') == 1 else 's'}, dtype "
             f"{models.get('main', {}).get('dtype')}; the demo model ({_bytes(models.get('main', {}).get('expert_bytes'))}"
             " per expert)" + (f" and its widened copy ({_bytes(models['widened'].get('expert_bytes'))} per expert)"
                               if models.get("widened", {}).get("expert_bytes") else "") + ". " + commit_sentence(res),
             ""]
    tier = _headline_tier(res)
    if tier:
        rows = {b: (sp, {}) for b, sp, _ in _pairs(res, "main", tier, "ondemand")}
        base = [o for o in HEADLINE_BASELINES if _pairs(res, "main", tier, o)]
        for o in base:
            for b, sp, r in _pairs(res, "main", tier, o):
                rows[b][1][o] = r
        sp0 = next(iter(rows.values()))[0]
        opts, t = sp0.get("effective_options", {}), res["tiers"][tier]
        lines += [f"Headline: demo model, experts on the **{t['label']}** tier, expert cache "
                  f"{t.get('cache_experts_per_layer')} of {models.get('main', {}).get('num_experts')} experts per "
                  f"MoE layer, greedy, SpecMoE N={opts.get('draft_experts')} draft experts, "
                  f"γ={opts.get('num_draft_tokens')}. Each ratio is SpecMoE's tokens/s over the other system's, at "
                  "the same batch and from the same run:", "",
                  "| batch | SpecMoE tok/s | " + " | ".join(f"vs {_label(res, o)}" for o in base)
                  + f" | decode bytes/token, SpecMoE vs {_label(res, 'ondemand')} |",
                  "|---|---|" + "---|" * len(base) + "---|"]
        for b, (sp, others) in sorted(rows.items()):
            cells = [str(b), _f(sp["tokens_per_s"])]
            cells += [_x(sp["tokens_per_s"] / others[o]["tokens_per_s"]) if o in others else "–" for o in base]
            od = others.get("ondemand", {})
            cells.append(f"{_bytes(sp.get('decode_bytes_per_token'))} vs {_bytes(od.get('decode_bytes_per_token'))}")
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    peers = [p for p in res.get("peers", []) if p.get("status") == "ok" and p.get("tokens_per_s")]
    if peers:
        batches = sorted({p["batch"] for p in peers})
        by = {}
        for p in peers:
            by.setdefault(p["label"], {})[p["batch"]] = p["tokens_per_s"]
        res_row = {b: r["tokens_per_s"] for b in batches if (r := _resident(res, "main", b))}
        entries = [(label, v) for label, v in by.items()] + [("specmoe engine, all experts resident", res_row)]
        lines += [f"Peers, same model and prompts, tokens/s at batch {' / '.join(map(str, batches))}: "
                  + "; ".join(f"{label} {' / '.join(_f(v.get(b), '{:.0f}') for b in batches)}"
                              for label, v in entries) + ".", ""]
    lines += ["What this says:", ""] + summary_lines(res) + [END]
    return "\n".join(lines)


def replace_block(text: str, block: str, where: str = "README.md") -> str:
    """`text` with the part from BEGIN to END (markers included) replaced by `block`."""
    from specmoe.errors import InputError
    i, j = text.find(BEGIN), text.find(END)
    if i < 0 or j < i:
        raise InputError(f"{where} has no results block (a line '{BEGIN}' followed by '{END}')")
    return text[:i] + block + text[j + len(END):]


def main(argv=None) -> int:
    """`python -m specmoe.bench.report [--results F] [--readme F] [--check] [--readme-only]`: rewrite the
    README's Results block and the results page next to results.json from results.json, and the list of
    results files in docs/benchmarks.md (--check: exit 1 if any differs, writing nothing)."""
    import argparse
    import json
    import sys
    p = argparse.ArgumentParser(prog="python -m specmoe.bench.report", description=main.__doc__)
    p.add_argument("--results", default=str(RESULTS))
    p.add_argument("--readme", default=str(README))
    p.add_argument("--check", action="store_true")
    p.add_argument("--readme-only", action="store_true", help="leave the results page (README.md next to "
                   "results.json) alone")
    a = p.parse_args(argv)
    res = json.loads(Path(a.results).read_text())
    readme = Path(a.readme)
    text = readme.read_text()
    new = {readme: replace_block(text, readme_block(res), str(readme))}
    if not a.readme_only:  # the results page next to results.json, with its preamble.md when there is one
        rdir = Path(a.results).parent
        pre = rdir / "preamble.md"
        new[rdir / "README.md"] = report_text(res, preamble=pre.read_text() if pre.is_file() else "")
        if rdir.resolve() == RESULTS.parent.resolve() and INDEX_DOC.is_file():  # docs/benchmarks.md's file list
            new[INDEX_DOC] = replace_index(INDEX_DOC.read_text(), results_index(rdir), str(INDEX_DOC))
    stale = [f for f, t in new.items() if not f.is_file() or f.read_text() != t]
    old = stale_code(res)
    if old:
        print(f"note: {a.results} was measured at {', '.join(c[:10] for c in old)}, whose specmoe/ differs from "
              "HEAD's; `make bench` measures this checkout", file=sys.stderr)
    if a.check:
        for f in stale:
            print(f"{f} differs from what {a.results} generates; run python -m specmoe.bench.report", file=sys.stderr)
        return 1 if stale else 0
    for f in stale:
        f.write_text(new[f])
    return 0



if __name__ == "__main__":
    raise SystemExit(main())
