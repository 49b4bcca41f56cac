"""benchmarks/over_ram.py's results, read back: per-system medians (and min–max) over the repeats, the ratios and
issue 36's targets per block (a workload under a memory limit), the plot, and the over-RAM block of
docs/over_ram.md (`over_ram.py --readme-only` rewrites it there; a test checks the page against it)."""
from __future__ import annotations

import json
import statistics
from pathlib import Path

GiB = 1 << 30
LLAMA = "llama.cpp"  # the system name of llama.cpp's runs


SUMMED = ("steady_tok_s", "first_tok_s", "prefill_s", "load_s", "read_bytes_per_token", "steady_read_bytes_per_token",
          "first_read_bytes_per_token", "device_read_bytes_per_token", "hit_rate", "peak_rss_anon_bytes",
          "peak_rss_file_bytes", "steady_footprint_bytes", "min_mem_available_bytes", "memory_budget_bytes",
          "load_read_bytes", "distinct_experts_per_layer", "cgroup_max_usage_bytes", "cgroup_pgmajfault",
          "cgroup_failcnt")
SPREAD = ("steady_tok_s", "read_bytes_per_token")


def figure(x: dict, k: str):
    """A run's figure `k`: its own field, or one read out of its routing windows / cgroup counters."""
    if k == "distinct_experts_per_layer":
        return (x.get("routing_windows") or {}).get("mean_distinct_per_layer_full_windows")
    if k.startswith("cgroup_"):
        cg = x.get("cgroup") or {}
        return {"cgroup_max_usage_bytes": cg.get("max_usage_bytes"), "cgroup_failcnt": cg.get("failcnt"),
                "cgroup_pgmajfault": (cg.get("memory_stat") or {}).get("total_pgmajfault")}[k]
    return x.get(k)


def summarize(runs: list[dict]) -> dict:
    """Per system: the median over its successful repeats of each figure, the largest residency after a run, and
    whether every repeat agreed token for token with the reference."""
    out = {}
    for name in dict.fromkeys(x["system"] for x in runs):
        ok = [x for x in runs if x["system"] == name and x.get("status") == "ok"]
        if not ok:
            out[name] = {"status": "none ok", "reasons": sorted({x.get("reason", "") for x in runs if x["system"] == name})}
            continue
        s = {"repeats_ok": len(ok), "statuses": {st: sum(x.get("status") == st for x in runs if x["system"] == name)
                                                  for st in sorted({x.get("status") for x in runs if x["system"] == name})}}
        for k in SUMMED:
            v = [figure(x, k) for x in ok if figure(x, k) is not None]
            s[k] = statistics.median(v) if v else None
        s["spread"] = {k: [min(v), max(v)] for k in SPREAD if (v := [x[k] for x in ok if x.get(k) is not None])}
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
        if "expert_memory_bytes" in ok[0] and all(x.get("memory_budget_bytes") is not None for x in ok):
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
    rb = (summary.get(LLAMA) or {}).get("read_bytes_per_token")
    for b in budgets:
        for s in spec_systems:
            v = tps(f"{s}@{b}")
            if v and base:
                out[f"{s}@{b} / {LLAMA}"] = v / base
            mine = (summary.get(f"{s}@{b}") or {}).get("read_bytes_per_token")
            if v and rb and mine is not None:
                out[f"{s}@{b} read bytes/token ÷ {LLAMA}"] = mine / rb
        lru, auto = tps(f"lru@{b}"), tps(f"auto@{b}")
        if lru and auto:
            out[f"auto@{b} / lru@{b}"] = auto / lru
            out[f"auto@{b} read bytes/token ÷ lru@{b}"] = (
                (summary[f"auto@{b}"].get("steady_read_bytes_per_token") or 0) /
                (summary[f"lru@{b}"].get("steady_read_bytes_per_token") or float("nan")))
        fx = tps(f"{fixed}@{b}")
        if lru and fx:
            out[f"{fixed}@{b} / lru@{b}"] = fx / lru
    return out


NON_SPECULATIVE = ("lru", "s3fifo", "adaptive", "lfu")  # plain decoding with a cache policy (overram_runs.POLICIES)


def targets(block: dict, budgets: list[str]) -> list[dict]:
    """Issue 36's targets, evaluated on this block's medians: {"target", "value", "met"} (value None: not
    measured). Which apply depends on the block's workload and model ÷ limit (issue 36: natural-forced at 2x and 3x:
    auto >= 1.5x llama.cpp, the best non-speculative policy >= 1.0x, auto's bytes read per token <= 0.5x
    llama.cpp's; at 1.5x auto >= 1.2x; sampled at 2x auto >= 1.2x); every block: each specmoe system's peak private
    memory <= the limit, 0 bytes of the repack cached after a run, and the specmoe systems' tokens equal."""
    sm, rt = block["summary"], block["ratios"]
    wl, kind = block.get("workload"), block.get("limit")
    factor = (block.get("limit_plan") or {}).get("factor")
    limit = (block.get("limit_plan") or {}).get("limit_bytes")
    out = []

    def add(text, value, ok):
        out.append({"target": text, "value": value, "met": None if value is None else bool(ok(value))})
    at = f"{wl} {factor:g}x ({kind})" if factor else f"{wl} ({kind})"
    for b in budgets:
        auto = rt.get(f"auto@{b} / {LLAMA}")
        if wl == "natural-forced" and factor in (2.0, 3.0):
            add(f"{at}: auto@{b} >= 1.5x llama.cpp tok/s", auto, lambda x: x >= 1.5)
            best = [v for k, v in rt.items() if k.endswith(f"@{b} / {LLAMA}") and k.split("@")[0] in NON_SPECULATIVE]
            add(f"{at}: best non-speculative policy @{b} >= 1.0x llama.cpp tok/s", max(best) if best else None,
                lambda x: x >= 1.0)
            add(f"{at}: auto@{b} bytes read per token <= 0.5x llama.cpp's", rt.get(f"auto@{b} read bytes/token ÷ {LLAMA}"),
                lambda x: x <= 0.5)
        if wl == "natural-forced" and factor == 1.5:
            add(f"{at}: auto@{b} >= 1.2x llama.cpp tok/s", auto, lambda x: x >= 1.2)
        if wl == "sampled" and factor == 2.0:
            add(f"{at}: auto@{b} >= 1.2x llama.cpp tok/s", auto, lambda x: x >= 1.2)
    for name, s in sm.items():
        if name == LLAMA or not s.get("repeats_ok"):
            continue
        if limit is not None:
            add(f"{at}: {name} peak private memory (RssAnon) <= the limit (GiB)", s["peak_rss_anon_bytes"] / GiB,
                lambda x: x <= limit / GiB)
        if "repack" in s.get("residency_after_max", {}):
            add(f"{at}: {name} bytes of the repack in the page cache after the run", s["residency_after_max"]["repack"],
                lambda x: x == 0)
    if "runs" in block:
        add(f"{at}: the specmoe systems' tokens equal each other's in every repeat (repeats that differ)",
            differing_repeats(block), lambda x: x == 0)
    return out


def differing_repeats(block: dict) -> int | None:
    """Repeats in which two specmoe systems that both ran produced different tokens (None: fewer than two ran)."""
    groups = {}
    for r in block["runs"]:
        if r.get("status") == "ok" and r["system"] != LLAMA:
            groups.setdefault(r["repeat"], set()).add(json.dumps(r["token_ids"]))
    if not any(len([x for x in block["runs"] if x.get("status") == "ok" and x["system"] != LLAMA
                    and x["repeat"] == k]) > 1 for k in groups):
        return None
    return sum(len(v) > 1 for v in groups.values())


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
DOC = Path(__file__).resolve().parents[2] / "docs" / "over_ram.md"  # the page that carries the generated block


def intro(res: dict) -> str:
    """What was measured, from the JSON: the model's size, the machine's RAM, llama-cpp-python's version, the limits."""
    gib = res["artifacts"]["plan"]["model_bytes"] / 2**30
    ram = (res.get("machine") or {}).get("ram_gib")
    version = (res.get("llama_cpp") or {}).get("version")
    llama = f"llama-cpp-python {version}" if version else "llama-cpp-python, its version not recorded by this run"
    kinds = sorted({b.get("limit") for b in res["blocks"] if b.get("limit") in ("cgroup", "balloon")})
    how = {"cgroup": "each run in its own cgroup v1 memory cgroup (memory.limit_in_bytes)",
           "balloon": "a balloon process holding RAM (emulated smaller RAM, labelled as such)"}
    return (f"A model larger than its memory: a {gib:.1f} GiB bf16 widened copy of the demo model (its routing) on a "
            f"{ram if ram is not None else '?'} GiB machine"
            + (", limited by " + " and ".join(how[k] for k in kinds) if kinds else "")
            + f", streamed from the SSD at batch 1 against llama.cpp ({llama}, bf16 GGUF, default mmap), by "
              "[`benchmarks/over_ram.py`](../benchmarks/over_ram.py) (what it measures: the sections above).")


def readme_block(res: dict) -> str:
    """docs/over_ram.md's over-RAM block (its links relative to docs/), from a results JSON."""
    f = res["flags"]
    mib = lambda v: "–" if v is None else f"{v / 2**20:.1f}"  # noqa: E731
    lines = [BEGIN, "", intro(res), "", f"Batch 1, {f.get('documents', '?')} held-out documents per run "
             f"({f['prompt_tokens']}-token prompts, {f['max_tokens']} tokens each: natural-forced = the document's "
             f"tokens fed one by one, sampled = temperature {f.get('temperature', '?')} with a seed per document), "
             f"{f['repeats']} repeat(s) with the systems' order alternated (median, min–max), each system a fresh "
             f"process with the model files dropped from the page cache first; {f['threads']} threads; specmoe "
             f"computes in {dtypes(res)} (experts stay bf16 on disk), llama.cpp in the GGUF's bf16; commit "
             f"`{res['commit'][:10]}` (`benchmarks/results/over_ram.json`):", "",
             "| workload | limit | model ÷ limit | system | steady tok/s (min–max) | ÷ llama.cpp | MiB read per token "
             "| ÷ llama.cpp's | hit rate | distinct experts / layer / 64 tokens | peak private GiB |",
             "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for b in res["blocks"]:
        if "summary" not in b:
            lines.append(f"| {b.get('workload', '?')} | {b.get('label', '?')} | – | – | skipped: "
                         f"{str(b.get('skipped', ''))[:120]} | | | | | | |")
            continue
        ref = (b["summary"].get(LLAMA) or {})
        for name, s in b["summary"].items():
            if not s.get("repeats_ok"):
                lines.append(f"| {b['workload']} | {b['limit']} | {b['model_over_ram']:.2f} | {name} | "
                             f"{', '.join(f'{k} {v}' for k, v in s.get('statuses', {}).items()) or s.get('status')} "
                             f"| | | | | | |")
                continue
            v, lo_hi = s["steady_tok_s"], s.get("spread", {}).get("steady_tok_s", [None, None])
            rb = s.get("read_bytes_per_token")
            hit = "–" if s.get("hit_rate") is None else f"{s['hit_rate']:.2f}"
            dist = "–" if s.get("distinct_experts_per_layer") is None else f"{s['distinct_experts_per_layer']:.1f}"
            tps_r = f"{v / ref['steady_tok_s']:.2f}×" if ref.get("steady_tok_s") else "–"
            rb_r = f"{rb / ref['read_bytes_per_token']:.2f}×" if ref.get("read_bytes_per_token") and rb is not None \
                else "–"
            lines.append(f"| {b['workload']} | {b['limit']} | {b['model_over_ram']:.2f} | {name} | {v:.2f} "
                         f"({lo_hi[0]:.2f}–{lo_hi[1]:.2f}) | {tps_r} | {mib(rb)} | {rb_r} | {hit} | {dist} | "
                         f"{s['peak_rss_anon_bytes'] / 2**30:.2f} |")
    note = ("llama.cpp's routing cannot be observed from llama-cpp-python (its distinct-experts cell is –). "
            "The issue's published figures for comparison: natural text touches 93–166 of the 192 experts in 64 "
            "tokens (about 15–28 per layer of 32); Mixtral offloading reports LRU hit rates of about 40–60%.")
    met = [t for b in res["blocks"] for t in b.get("targets", [])]
    if met:
        note += " Targets (issue 36): " + "; ".join(
            f"{t['target']}: {'not measured' if t['value'] is None else _val(t['value'])} "
            f"{'' if t['met'] is None else ('**met**' if t['met'] else '**unmet**')}".rstrip() for t in met) + "."
    lines += ["", note]
    splits = []
    for b in res["blocks"]:
        ref = (b.get("summary", {}).get(LLAMA) or {}).get("steady_tok_s")
        split = [f"{name} {t['target_expert_compute_s']:.3f} + {t['fetch_wait_s']:.3f} of {t['decode_wall_s']:.3f}"
                 for name, s in b.get("summary", {}).items() if (t := s.get("seconds_per_decoded_token"))
                 and all(k in t for k in ("target_expert_compute_s", "fetch_wait_s", "decode_wall_s"))]
        if split:
            splits.append(f"{b['label']}: {'; '.join(split)}" + (f" (llama.cpp: {1 / ref:.3f} in all)" if ref else ""))
    if splits:
        lines += ["", "Seconds per decoded token in expert compute + fetch wait, of the whole decode: "
                  + ". ".join(splits) + "."]
    return "\n".join(lines + ["", END])


def _val(v) -> str:
    return f"{v:.3g}" if isinstance(v, float) else str(v)


def dtypes(res: dict) -> str:
    """The compute dtype(s) the specmoe runs resolved (`--dtype auto`: the engine's rule on this CPU)."""
    got = sorted({r["dtype"] for b in res["blocks"] for r in b.get("runs", []) if r.get("dtype")})
    rule = " (`dtype=\"auto\"`: this CPU's bf16 matmul is slower than fp32)" if got == ["float32"] and \
        res["flags"].get("dtype", "auto") == "auto" else ""
    return " / ".join(got) + rule if got else "the dtype it was given"


def same(block: dict, name: str) -> str:
    runs = [r for r in block["runs"] if r["system"] == name and r.get("status") == "ok"]
    return f"{sum(bool((r.get('agreement') or {}).get('identical')) for r in runs)} of {len(runs)}"


def write_readme(res: dict, readme: Path | None = None) -> None:
    """Rewrite the over-RAM block of `readme` (default DOC, docs/over_ram.md; the name is kept from when the block
    lived in README.md)."""
    readme = Path(readme) if readme is not None else DOC
    text = readme.read_text()
    i, j = text.index(BEGIN), text.index(END) + len(END)
    readme.write_text(text[:i] + readme_block(res) + text[j:])
