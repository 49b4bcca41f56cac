"""Merge a re-run of part of a benchmark into an earlier results dict: the rows of one (model, tier)
and the SpecMoE sweeps are taken from the re-run, everything else from the base run. Every row
keeps the run it came from (`run`: 1 = base, 2 = re-run); ratios are recomputed per tier, so
they only ever divide numbers of the same run."""
from __future__ import annotations

import copy
import json
from pathlib import Path


def merge(base: dict, rerun: dict, *, model: str = "main", tier: str = "disk", sweeps: bool = True) -> dict:
    from specmoe.bench.runner import headline
    out = copy.deepcopy(base)
    for r in out["runs"]:
        r.setdefault("run", 1)
    out["runs"] = [r for r in out["runs"] if not (r.get("model") == model and r.get("tier") == tier)]
    out["runs"] += [{**r, "run": 2} for r in rerun["runs"] if r.get("model") == model and r.get("tier") == tier]
    if sweeps:
        out["sweeps"] = {k: {**v, "rows": [{**r, "run": 2} for r in v.get("rows", [])]}
                         for k, v in rerun.get("sweeps", {}).items()}
    out["merged_from"] = [{"run": i + 1, "command": r.get("command"), "created_utc": r.get("created_utc"),
                           "elapsed_s": r.get("elapsed_s"), "loadavg_at_start": r["machine"].get("loadavg_at_start"),
                           "loadavg_at_end": r.get("loadavg_at_end"), "git_commit": r["machine"].get("git_commit"),
                           "git_dirty": r["machine"].get("git_dirty")}
                          for i, r in enumerate((base, rerun))]
    out["notes"] = list(out.get("notes", [])) + [
        f"merged: rows of model '{model}' at tier '{tier}'" + (" and the SpecMoE sweeps" if sweeps else "") +
        " come from run 2 (see merged_from); everything else from run 1. Speedups divide rows of the same "
        "run, except 'vs resident', whose reference rows are run 1's."]
    out["headline"] = headline(out["runs"])
    return out


def merge_files(base: str | Path, rerun: str | Path, out_dir: str | Path, **kw) -> dict:
    from specmoe.bench.plots import make_plots
    from specmoe.bench.report import make_report
    from specmoe.bench.runner import write
    res = merge(json.loads(Path(base).read_text()), json.loads(Path(rerun).read_text()), **kw)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    res["plots"] = make_plots(res, out_dir)
    write(res, out_dir)
    make_report(res, out_dir)
    return res
