"""PNG figures from a results dict (matplotlib, Agg). Each function draws one figure from the
rows that ran and returns its file name, or None when the run holds nothing to draw."""
from __future__ import annotations

from pathlib import Path

EMU = " [emulated link]"


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


_SKIPPED: set[str] = set()  # plots already reported skipped (a benchmark rewrites its files after every block)


def plot_or_skip(draw, res: dict, path: Path):
    """`draw(res, path)`'s result when matplotlib is importable (it is the [bench] extra); else False, after one
    printed line (once per path) saying the plot is skipped: a benchmark writes its JSON whether or not it can
    draw it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as e:
        if str(path) not in _SKIPPED:
            _SKIPPED.add(str(path))
            print(f"plot {path} skipped: matplotlib is not importable ({e}); pip install 'specmoe[bench]' to draw it",
                  flush=True)
        return False
    return draw(res, path)


def write_results(res: dict, out, draw) -> None:
    """A benchmark's results: the JSON at `out` (folders made), then its plot beside it (`draw(res, png)`, or the
    skip line of `plot_or_skip`), then one line naming what was written."""
    import json
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1) + "\n")
    png = out.with_suffix(".png")
    png = None if plot_or_skip(draw, res, png) is False else png
    print(f"wrote {out}{f' and {png}' if png else ''}")


def _ok(runs, **match):
    return [r for r in runs if r.get("status") == "ok" and "sweep" not in r
            and all(r.get(k) == v for k, v in match.items())]


def _tier_title(res, tier):
    t = res.get("tiers", {}).get(tier, {})
    if tier == "none":
        return "resident"
    if t.get("emulated"):
        return f"host RAM, emulated link {t.get('link_gbps')} GB/s, {t.get('link_latency_us')} µs{EMU}"
    if tier == "disk":
        direct = any(r.get("stats", {}).get("direct_io") for r in res["runs"] if r.get("tier") == "disk")
        return "disk (O_DIRECT reads, no page cache)" if direct else "disk (buffered reads)"
    return tier


def _by_system(rows):
    out: dict[str, list] = {}
    for r in rows:
        out.setdefault(r["system"], []).append(r)
    return {k: sorted(v, key=lambda r: r["batch"]) for k, v in out.items()}


def _vs_batch(res, out: Path, model: str, key: str, ylabel: str, fname: str, title: str, logy: bool = False):
    runs = res["runs"]
    tiers = [t for t in res.get("tiers", {}) if _ok(runs, model=model, tier=t)]
    if not tiers:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, len(tiers), figsize=(6 * len(tiers), 4.2), squeeze=False)
    ref = _ok(runs, model=model, tier="none")
    for ax, tier in zip(axes[0], tiers):
        rows = _ok(runs, model=model, tier=tier) + (ref if key == "tokens_per_s" else [])
        for name, rs in _by_system(rows).items():
            pts = [(r["batch"], r.get(key)) for r in rs if r.get(key) is not None]
            if pts:
                style = "--" if name == "resident" else "-"
                ax.plot(*zip(*pts), style, marker="o", label=rs[0].get("label", name))
        ax.set_xscale("log", base=2)
        if logy:
            ax.set_yscale("log")
        ax.set_xlabel("batch size")
        ax.set_ylabel(ylabel)
        ax.set_title(_tier_title(res, tier), fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"{title} — {model} model", fontsize=11)
    fig.tight_layout()
    fig.savefig(out / fname, dpi=110)
    plt.close(fig)
    return fname


def plot_tau_vs_gamma(res, out: Path):
    sw = res.get("sweeps", {}).get("gamma", {})
    rows = [r for r in sw.get("rows", []) if r.get("status") == "ok" and r.get("tokens_per_step") is not None]
    if not rows:
        return None
    plt = _plt()
    rows.sort(key=lambda r: r["value"])
    g = [r["value"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 4.2))
    ax.plot(g, [r["tokens_per_step"] for r in rows], "o-", label="τ (tokens per step)")
    ax.plot(g, [x + 1 for x in g], ":", color="gray", label="γ+1 (upper bound)")
    ax.set_xlabel("γ (draft tokens per step)")
    ax.set_ylabel("τ")
    ax2 = ax.twinx()
    ax2.plot(g, [r["tokens_per_s"] for r in rows], "s--", color="C3", label="tokens/s")
    ax2.set_ylabel("tokens/s", color="C3")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax2.legend(h1 + h2, l1 + l2, loc="upper center", fontsize=8)  # on the top axes, so no line covers it
    ax.grid(alpha=0.3)
    ax.set_title(f"SpecMoE τ vs γ — batch {sw.get('batch')}, tier {sw.get('tier')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out / "tau_vs_gamma.png", dpi=110)
    plt.close(fig)
    return "tau_vs_gamma.png"


def plot_breakdown(res, out: Path, model: str = "main"):
    """Decode time per generated token, split into fetch wait / expert compute / the rest."""
    runs = [r for r in res["runs"] if r.get("status") == "ok" and "sweep" not in r and r.get("model") == model
            and r.get("breakdown")]
    tier = next((t for t in res.get("tiers", {}) if any(r["tier"] == t for r in runs)), None)
    if tier is None:
        return None
    rows = [r for r in runs if r["tier"] in (tier, "none")]
    batch = max(r["batch"] for r in rows)
    rows = [r for r in rows if r["batch"] == batch]
    plt = _plt()
    fig, ax = plt.subplots(figsize=(1.3 * len(rows) + 3, 4.5))
    names, parts = [], {"fetch wait": [], "expert compute": [], "draft phase": [], "attention / other": []}
    for r in rows:
        b = r["breakdown"]
        n = max(1, r["generated_tokens"] - r["batch"])
        ms = lambda s: 1e3 * s / n  # noqa: E731
        names.append(r["system"])
        parts["fetch wait"].append(ms(b["fetch_wait_s"]))
        parts["expert compute"].append(ms(b["expert_compute_s"]))
        draft = b.get("draft_time_s", 0.0) or 0.0
        parts["draft phase"].append(ms(draft))
        parts["attention / other"].append(ms(max(0.0, b["decode_time_s"] - b["fetch_wait_s"] - b["expert_compute_s"]
                                                 - draft)))
    x = range(len(names))
    bottom = [0.0] * len(names)
    for label, vals in parts.items():
        ax.bar(x, vals, bottom=bottom, label=label, width=0.6)
        bottom = [a + v for a, v in zip(bottom, vals)]
    ax.set_xticks(list(x))
    ax.set_xticklabels(names, rotation=20, fontsize=8)
    ax.set_ylabel("ms per generated token (decode)")
    ax.set_title(f"Decode time breakdown — batch {batch}, {_tier_title(res, tier)}", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fname = "time_breakdown.png" if model == "main" else f"time_breakdown_{model}.png"
    ax.set_title(f"Decode time breakdown — {model} model, batch {batch}, {_tier_title(res, tier)}", fontsize=9)
    fig.savefig(out / fname, dpi=110)
    plt.close(fig)
    return fname


def _matrix(counts):
    """expert_counts as [layers][experts] from a dict {layer: [E]} or a nested list."""
    if isinstance(counts, dict):
        keys = sorted(counts, key=lambda k: int(k))
        return [list(counts[k]) for k in keys], [int(k) for k in keys]
    if isinstance(counts, list) and counts and isinstance(counts[0], list):
        return counts, list(range(len(counts)))
    return None, None


def plot_hotness(res, out: Path):
    """Per-layer expert activation counts (SpecMoE Fig. 6) from the engine's stats["expert_counts"],
    else from the bench's own count of forwards that needed each expert."""
    runs = [r for r in res["runs"] if r.get("status") == "ok" and r.get("model") == "main" and "sweep" not in r]
    src, row = None, None
    for key in ("expert_counts", "expert_forwards"):
        cand = [r for r in runs if r.get(key)]
        if cand:
            row = max(cand, key=lambda r: (r["system"] in ("resident", "ondemand"), r["batch"]))
            src = key
            break
    if row is None:
        return None
    m, layers = _matrix(row[src])
    if not m:
        return None
    plt = _plt()
    import numpy as np
    a = np.asarray(m, dtype=float)
    a = a / np.maximum(a.sum(axis=1, keepdims=True), 1)
    fig, ax = plt.subplots(figsize=(max(6, a.shape[1] * 0.25), 1 + 0.45 * a.shape[0]))
    im = ax.imshow(a, aspect="auto", cmap="viridis")
    ax.set_yticks(range(len(layers)))
    ax.set_yticklabels(layers)
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    what = "routed token-expert assignments" if src == "expert_counts" else "forwards that needed the expert"
    ax.set_title(f"Expert hotness (share of {what} per layer) — {row['system']}, batch {row['batch']}", fontsize=9)
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    fig.savefig(out / "expert_hotness.png", dpi=110)
    plt.close(fig)
    return "expert_hotness.png"


def plot_peers(res, out: Path):
    peers = [p for p in res.get("peers", []) if p.get("status") == "ok"]
    ours = [r for r in res["runs"] if r.get("status") == "ok" and r.get("model") == "main" and "sweep" not in r
            and r["batch"] in {p["batch"] for p in peers}]
    if not peers:
        return None
    plt = _plt()
    bars = [(f"{p['peer']}", p["batch"], p["tokens_per_s"]) for p in peers]
    bars += [(f"specmoe:{r['system']}@{r['tier']}", r["batch"], r["tokens_per_s"]) for r in ours]
    batches = sorted({b for _, b, _ in bars})
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4.5), squeeze=False)
    for ax, b in zip(axes[0], batches):
        sel = [x for x in bars if x[1] == b]
        ax.barh([x[0] for x in sel], [x[2] for x in sel], color=["C1" if not x[0].startswith("specmoe") else "C0"
                                                               for x in sel])
        ax.set_xlabel("tokens/s (incl. prefill)")
        ax.set_title(f"batch {b}", fontsize=10)
        ax.tick_params(axis="y", labelsize=7)
        ax.grid(alpha=0.3, axis="x")
    fig.suptitle("specmoe systems vs peers (same model, prompts, tokens)", fontsize=11)
    fig.tight_layout()
    fig.savefig(out / "peers.png", dpi=110)
    plt.close(fig)
    return "peers.png"


def make_plots(res: dict, out: str | Path) -> dict:
    out = Path(out)
    made = {}
    for model in ("main", "widened"):
        sfx = "" if model == "main" else "_widened"
        made[f"throughput{sfx}"] = _vs_batch(res, out, model, "tokens_per_s", "tokens/s (generated / wall, incl. prefill)",
                                             f"throughput_vs_batch{sfx}.png", "Throughput vs batch (cf. SpecMoE Fig. 11)")
        made[f"bytes{sfx}"] = _vs_batch(res, out, model, "decode_bytes_per_token",
                                        "expert bytes moved per decoded token (prefill excluded)",
                                        f"bytes_vs_batch{sfx}.png", "Bytes moved vs batch (cf. Fig. 12)", logy=True)
    made["tau_vs_gamma"] = plot_tau_vs_gamma(res, out)
    made["time_breakdown"] = plot_breakdown(res, out)
    made["time_breakdown_widened"] = plot_breakdown(res, out, "widened")
    made["expert_hotness"] = plot_hotness(res, out)
    made["peers"] = plot_peers(res, out)
    return {k: v for k, v in made.items() if v}
