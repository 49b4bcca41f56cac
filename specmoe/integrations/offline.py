"""`specmoe batch`'s run: read the input, skip rows finished by an earlier run, send the rest in batches
to the predictor (on Ray workers, or in this process with num_workers=0: the same predictor), journal
finished rows as they arrive, write the output in input order, and sum throughput and expert traffic."""
from __future__ import annotations

import os
import sys
import time
from dataclasses import fields
from pathlib import Path

from tqdm import tqdm

from specmoe.errors import InputError
from specmoe.integrations import batch_io
from specmoe.options import SpecConfig, check_int


def settings_of(llm: dict, defaults: dict) -> dict:
    """What decides the output rows; a resumed run must use the same (offload options do not change
    output: offloaded equals resident bit for bit; workers and batch size change only the schedule)."""
    from specmoe.engine.llm import default_model_path
    model = llm.get("model")
    spec = {f.name: llm[f.name] if llm.get(f.name) is not None else f.default for f in fields(SpecConfig)}
    return {"model": str(Path(model).resolve() if model else default_model_path()), "dtype": str(llm.get("dtype", "auto")),
            "max_model_len": llm.get("max_model_len"), "decoding": spec, "defaults": defaults}


def run_batch(input: str | Path, output: str | Path, *, llm: dict | None = None, defaults: dict | None = None,
              num_workers: int = 1, ray_address: str | None = None, batch_size: int | None = None,
              cpus_per_worker: int = 1, gpus_per_worker: float = 0, progress: bool = True) -> dict:
    """Complete every row of `input` into `output` (see batch_io for formats and resuming). `llm`: LLM
    keywords for each worker's engine; `defaults`: SamplingParams fields for rows that do not set them.
    Returns the summary (rows, throughput, expert traffic in total and per worker)."""
    from specmoe.decoding.runtime.sampling import SamplingParams
    llm, defaults = dict(llm or {}), dict(defaults or {})
    check_int("num_workers", num_workers, 0)
    check_int("cpus_per_worker", cpus_per_worker, 1)
    check_int("batch_size", batch_size, 1, none_ok=True)
    SamplingParams(**defaults)  # bad defaults fail before any work
    if num_workers:
        from specmoe.integrations import ray as ray_exec
        ray_exec.require_ray()  # the install hint before any file is touched
    src, dst = Path(input), Path(output)
    batch_io.file_format(dst, "output file")
    if dst.resolve() == src.resolve():
        raise InputError(f"output file {dst} is the input file; choose another path")
    if not dst.parent.is_dir():
        raise InputError(f"output directory not found: {dst.parent}")
    inputs = batch_io.read_input(src)
    settings = batch_io.normalize(settings_of(llm, defaults))
    done = batch_io.load_finished(inputs, dst, settings)
    pending = [i for i in range(len(inputs)) if i not in done]
    size = batch_size or llm.get("max_batch", 256)
    batches = [[inputs.work_row(i) for i in pending[j:j + size]] for j in range(0, len(pending), size)]
    summary = {"rows": len(inputs), "resumed": len(done), "num_workers": num_workers, "batch_size": size}
    journal = batch_io.Journal(dst, inputs, settings, [done[i] for i in sorted(done)])
    started, finished_ok, predictor = False, False, None
    fresh: list[dict] = []
    try:
        t0 = time.perf_counter()
        if batches and num_workers:
            started = ray_exec.connect(ray_address, num_cpus=max(os.cpu_count() or 1, num_workers * cpus_per_worker))
            ray_exec.prepare(llm, progress=progress)
            if llm.get("threads") is None:  # torch threads = the CPUs Ray reserved for the worker
                llm["threads"] = cpus_per_worker
            results = ray_exec.run_batches(batches, llm=llm, defaults=defaults, num_workers=num_workers,
                                           cpus_per_worker=cpus_per_worker, gpus_per_worker=gpus_per_worker)
        elif batches:
            from specmoe.integrations.predictor import SpecMoEPredictor
            predictor = SpecMoEPredictor(llm=llm, defaults=defaults)
            results = (predictor.predict_rows(b) for b in batches)
        else:
            results = iter(())
        summary["startup_s"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        with tqdm(total=len(inputs), initial=len(done), unit="row", desc="rows", disable=not progress,
                  file=sys.stderr) as bar:
            for rows in results:
                summary.setdefault("first_batch_s", time.perf_counter() - t1)  # includes the workers' start
                # a row twice (a retried task answering again) is kept once
                rows = [inputs.complete(r) for r in rows if r["index"] not in done]
                journal.append(rows)
                done.update((r["index"], r) for r in rows)
                fresh += rows
                bar.update(len(rows))
        summary["wall_s"] = time.perf_counter() - t1
        missing = [i for i in range(len(inputs)) if i not in done]
        if missing:  # the executor must return every row it was given
            raise RuntimeError(f"{len(missing)} rows came back missing (first: {missing[:5]}); rerun to finish them")
        batch_io.write_output(dst, [done[i] for i in range(len(inputs))])
        finished_ok = True
    except KeyboardInterrupt:
        print(f"specmoe: {len(done)} of {len(inputs)} rows are saved in {journal.path}; rerun the same command "
              "to finish the rest", file=sys.stderr)
        raise
    finally:
        journal.close(remove=finished_ok)
        if predictor is not None:
            predictor.close()
        if started:
            ray_exec.shutdown()
    return {**summary, **totals(fresh, summary.get("wall_s", 0.0))}


def totals(rows: list[dict], wall_s: float) -> dict:
    """Throughput and expert traffic of the rows processed in this run, in total and per worker."""
    ok = [r for r in rows if r["error"] is None]
    gen = sum(r["generated_tokens"] for r in ok)
    moved = sum(r["expert_bytes"] for r in ok)
    workers: dict[str, dict] = {}
    for r in ok:
        w = workers.setdefault(r["worker"], {"rows": 0, "generated_tokens": 0, "expert_bytes": 0})
        w["rows"] += 1
        w["generated_tokens"] += r["generated_tokens"]
        w["expert_bytes"] += r["expert_bytes"]
    for w in workers.values():
        w["expert_bytes_per_token"] = w["expert_bytes"] / w["generated_tokens"] if w["generated_tokens"] else 0.0
    taus = [r["tokens_per_step"] for r in ok if r["tokens_per_step"] is not None]
    return {"processed": len(rows), "errors": len(rows) - len(ok),
            "error_examples": [f"row {r['index']}: {r['error']}" for r in rows if r["error"] is not None][:3],
            "generated_tokens": gen, "prompt_tokens": sum(r["prompt_tokens"] for r in ok),
            "rows_per_s": len(rows) / wall_s if wall_s else 0.0, "tokens_per_s": gen / wall_s if wall_s else 0.0,
            "expert_bytes": moved, "expert_bytes_per_token": moved / gen if gen else 0.0,
            "tokens_per_step": sum(taus) / len(taus) if taus else None, "workers": workers}
