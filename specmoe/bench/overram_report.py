"""benchmarks/over_ram.py's results, read back: per-system medians over the repeats, the ratios and issue 26's
targets per block, the plot, and the README's over-RAM block (`over_ram.py --readme-only`; a test checks the README
against it)."""
from __future__ import annotations

import statistics
from pathlib import Path

GiB = 1 << 30
LLAMA = "llama.cpp"  # the system name of llama.cpp's runs


SUMMED = ("steady_tok_s", "first_tok_s", "prefill_s", "load_s", "read_bytes_per_token", "steady_read_bytes_per_token",
          "first_read_bytes_per_token", "device_read_bytes_per_token", "hit_rate", "peak_rss_anon_bytes",
          "peak_rss_file_bytes", "steady_footprint_bytes", "min_mem_available_bytes", "memory_budget_bytes")


def summarize(runs: list[dict]) -> dict:
    """Per system: the median over its successful repeats of each figure, the largest residency after a run, and
    whether every repeat agreed token for token with the reference."""
    out = {}
    for name in dict.fromkeys(x["system"] for x in runs):
        ok = [x for x in runs if x["system"] == name and x.get("status") == "ok"]
        if not ok:
            out[name] = {"status": "none ok", "reasons": sorted({x.get("reason", "") for x in runs if x["system"] == name})}
            continue
        s = {"repeats_ok": len(ok)}
        for k in SUMMED:
            v = [x[k] for x in ok if x.get(k) is not None]
            s[k] = statistics.median(v) if v else None
        s["residency_after_max"] = {f: max(x["residency_after"][f]["resident_bytes"] for x in ok)
                                    for f in ok[0]["residency_after"]}
        s["all_agree"] = all(x.get("agreement", {}).get("identical") for x in ok)
        s["agreement"] = [x.get("agreement") for x in ok]
        if "stats" in ok[0]:  # specmoe: where a decoded token's time went (the engine's decode-step breakdown)
            parts = [x["stats"].get("step_breakdown", {}) for x in ok]
            s["seconds_per_decoded_token"] = {k: statistics.median(p[k] / (x["tokens"] - 1) for p, x in zip(parts, ok))
                                              for k in parts[0] if all(p.get(k) is not None for p in parts)}
            io = [{k: x["stats"].get(k) for k in ("io_reads", "io_read_s", "io_verify_s")} for x in ok]
            s["disk_tier_io_whole_run"] = {k: statistics.median(d[k] for d in io) for k in io[0]
                                           if all(d[k] is not None for d in io)}  # prefill included
        if "expert_memory_bytes" in ok[0]:
            s["private_over_budget_bytes"] = max(x["peak_rss_anon_bytes"] - x["memory_budget_bytes"] for x in ok)
        out[name] = s
    return out


def ratios(summary: dict, budgets: list[str], spec_systems: list[str], fixed: str) -> dict:
    """Steady tok/s ratios: every specmoe system ÷ llama.cpp, auto ÷ LRU and the fixed system ÷ LRU per budget,
    with auto's and LRU's storage reads per token beside them."""
    def tps(n):
        return (summary.get(n) or {}).get("steady_tok_s")
    out = {}
    base = tps(LLAMA)
    for b in budgets:
        for s in spec_systems:
            v = tps(f"{s}@{b}")
            if v and base:
                out[f"{s}@{b} / {LLAMA}"] = v / base
        lru, auto = tps(f"lru@{b}"), tps(f"auto@{b}")
        if lru and auto:
            out[f"auto@{b} / lru@{b}"] = auto / lru
            out[f"auto@{b} read bytes/token ÷ lru@{b}"] = (
                (summary[f"auto@{b}"]["steady_read_bytes_per_token"] or 0) /
                (summary[f"lru@{b}"]["steady_read_bytes_per_token"] or float("nan")))
        fx = tps(f"{fixed}@{b}")
        if lru and fx:
            out[f"{fixed}@{b} / lru@{b}"] = fx / lru
    return out


def targets(block: dict, budgets: list[str]) -> list[dict]:
    """Issue 26's targets, evaluated on this block's medians: {"target", "value", "met"} (value None: not measured).
    A block whose model is < 1.6x its RAM gets the 1.2x-RAM targets, else the 2x-RAM ones."""
    sm, rt = block["summary"], block["ratios"]
    fixed = [b for b in budgets if b != "llama"]
    out = []

    def add(text, value, ok):
        out.append({"target": text, "value": value, "met": None if value is None else bool(ok(value))})
    for name, s in sm.items():
        if "private_over_budget_bytes" in s:
            v = s["private_over_budget_bytes"] / GiB
            add(f"{name}: private memory (peak RssAnon) <= budget + 1.5 GiB (GiB over budget)", v, lambda x: x <= 1.5)
        if "private_over_budget_bytes" in s and "repack" in s["residency_after_max"]:
            v = s["residency_after_max"]["repack"] / 2**20
            add(f"{name}: ~0 bytes of the repack in the page cache after the run (MiB)", v, lambda x: x <= 64)
    if block["model_over_ram"] < 1.6:
        add("LRU at llama.cpp's footprint >= 1.0x llama.cpp tok/s", rt.get(f"lru@llama / {LLAMA}"), lambda x: x >= 1.0)
        for b in fixed:
            add(f"LRU at {b} >= 0.7x llama.cpp tok/s", rt.get(f"lru@{b} / {LLAMA}"), lambda x: x >= 0.7)
    else:
        for b in fixed + ["llama"]:
            add(f"LRU at {b} >= 1.5x llama.cpp tok/s", rt.get(f"lru@{b} / {LLAMA}"), lambda x: x >= 1.5)
            add(f"auto at {b} >= 2x llama.cpp tok/s", rt.get(f"auto@{b} / {LLAMA}"), lambda x: x >= 2.0)
    for b in fixed + ["llama"]:
        add(f"auto at {b} >= 1.2x LRU tok/s", rt.get(f"auto@{b} / lru@{b}"), lambda x: x >= 1.2)
        add(f"auto at {b}: fewer storage bytes per token than LRU (ratio)", rt.get(f"auto@{b} read bytes/token ÷ lru@{b}"),
            lambda x: x < 1.0)
    return out


def plot(res: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    blocks = [b for b in res["blocks"] if "summary" in b]
    if not blocks:
        return
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    names = list(dict.fromkeys(n for b in blocks for n in b["summary"]))
    w = 0.8 / max(1, len(blocks))
    for j, b in enumerate(blocks):
        lab = f"{b['label']}, model {b['model_over_ram']:.2f}x RAM"
        xs = [i + j * w for i in range(len(names))]
        axes[0].bar(xs, [(b["summary"].get(n) or {}).get("steady_tok_s") or 0 for n in names], w, label=lab)
        axes[1].bar(xs, [((b["summary"].get(n) or {}).get("steady_read_bytes_per_token") or 0) / 2**20 for n in names],
                    w, label=lab)
    for ax, yl in zip(axes, ("steady tok/s (tokens after the first window, median)", "MiB read from storage per token")):
        ax.set_xticks([i + w * (len(blocks) - 1) / 2 for i in range(len(names))], names, rotation=30, ha="right",
                      fontsize=8)
        ax.set_ylabel(yl)
        ax.legend(fontsize=7)
    fig.suptitle(f"{'DRY RUN (tiny widened copy): ' if res['dry_run'] else ''}batch 1 from SSD, "
                 f"model {res['artifacts']['plan']['model_bytes'] / 1e9:.1f} GB bf16, commit {str(res['commit'])[:10]}",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


BEGIN, END = "<!-- over-ram:begin (generated by benchmarks/over_ram.py) -->", "<!-- over-ram:end -->"


def intro(res: dict) -> str:
    """What was measured, from the JSON: the model's size, the machine's RAM, llama-cpp-python's version."""
    gib = res["artifacts"]["plan"]["model_bytes"] / 2**30
    ram = (res.get("machine") or {}).get("ram_gib")
    version = (res.get("llama_cpp") or {}).get("version")
    llama = f"llama-cpp-python {version}" if version else "llama-cpp-python, its version not recorded by this run"
    balloon = any("balloon" in b["label"] and "no balloon" not in b["label"] for b in res["blocks"])
    return (f"A model larger than RAM: a {gib:.0f} GiB bf16 widened copy of the demo model on a "
            f"{ram if ram is not None else '?'} GiB machine"
            + (", and the same with a balloon process holding RAM (emulated smaller RAM, labelled as such)"
               if balloon else "")
            + f", streamed from the SSD at batch 1 against llama.cpp ({llama}, bf16 GGUF, default mmap), by "
              "[`benchmarks/over_ram.py`](benchmarks/over_ram.py).")


def readme_block(res: dict) -> str:
    """The README's over-RAM table, from a results JSON."""
    f = res["flags"]
    lines = [BEGIN, "", intro(res), "", f"Batch 1, greedy, {f['prompt_tokens']}-token prompts, {f['max_tokens']} new tokens (first "
             f"{f['window']} timed apart, steady = the rest), {f['repeats']} repeat(s) with the systems' order "
             f"alternated, each system a fresh process with the model files dropped from the page cache first; "
             f"{f['threads']} threads; specmoe computes in {dtypes(res)} (experts stay bf16 on disk), llama.cpp in "
             f"the GGUF's bf16; commit `{res['commit'][:10]}` (`benchmarks/results/over_ram.json`):", "",
             "| RAM | model ÷ RAM | system | steady tok/s | ÷ llama.cpp | first tok/s | MiB read per token (steady) "
             "| expert hit rate | peak private GiB | repeats with llama.cpp's tokens |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for b in res["blocks"]:
        ref = (b["summary"].get("llama.cpp") or {}).get("steady_tok_s")
        for name, s in b["summary"].items():
            if not s.get("repeats_ok"):
                continue
            v = s["steady_tok_s"]
            hit = "–" if s.get("hit_rate") is None else f"{s['hit_rate']:.2f}"
            lines.append(f"| {b['label']} | {b['model_over_ram']:.2f} | {name} | {v:.2f} | "
                         f"{'–' if not ref else f'{v / ref:.2f}×'} | {s['first_tok_s']:.2f} | "
                         f"{s['steady_read_bytes_per_token'] / 2**20:.1f} | {hit} | "
                         f"{s['peak_rss_anon_bytes'] / 2**30:.2f} | {same(b, name)} |")
    equal = all(len({tuple(r["token_ids"]) for r in b["runs"] if r.get("status") == "ok" and r["system"] != LLAMA
                     and r["repeat"] == k}) <= 1 for b in res["blocks"] for k in range(f["repeats"]))
    lines += ["", f"Every specmoe system's tokens equal the other specmoe systems' in every repeat: "
              f"{'yes' if equal else 'no'}; the last column compares with llama.cpp's tokens."]
    for b in res["blocks"]:
        ref = (b["summary"].get(LLAMA) or {}).get("steady_tok_s")
        split = [f"{name} {t['target_expert_compute_s']:.3f} + {t['fetch_wait_s']:.3f} of {t['decode_wall_s']:.3f}"
                 for name, s in b["summary"].items() if (t := s.get("seconds_per_decoded_token"))]
        skipped = sorted({r["system"] for r in b["runs"] if r.get("status") == "skipped"})
        if split:
            lines += [f"{b['label']}: seconds per decoded token in expert compute + fetch wait, of the whole "
                      f"decode: {'; '.join(split)}" + (f" (llama.cpp: {1 / ref:.3f} per token in all)" if ref else "")
                      + "." + (f" Not run (the balloon's memory floor): {', '.join(skipped)}." if skipped else "")]
    return "\n".join(lines + ["", END])


def dtypes(res: dict) -> str:
    """The compute dtype(s) the specmoe runs resolved (`--dtype auto`: the engine's rule on this CPU)."""
    got = sorted({r["dtype"] for b in res["blocks"] for r in b.get("runs", []) if r.get("dtype")})
    rule = " (`dtype=\"auto\"`: this CPU's bf16 matmul is slower than fp32)" if got == ["float32"] and \
        res["flags"].get("dtype", "auto") == "auto" else ""
    return " / ".join(got) + rule if got else "the dtype it was given"


def same(block: dict, name: str) -> str:
    runs = [r for r in block["runs"] if r["system"] == name and r.get("status") == "ok"]
    return f"{sum(bool((r.get('agreement') or {}).get('identical')) for r in runs)} of {len(runs)}"


def write_readme(res: dict, readme: Path) -> None:
    text = readme.read_text()
    i, j = text.index(BEGIN), text.index(END) + len(END)
    readme.write_text(text[:i] + readme_block(res) + text[j:])
