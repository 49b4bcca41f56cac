"""Ray Data: run `SpecMoEPredictor` on a pool of Ray actors (one engine each) over batches of rows.

`connect` joins a running cluster (`ray start --head` on one machine, `ray start --address HEAD:6379` on
the others) or starts a local instance; `prepare` builds what the workers share read-only (the disk
tier's repack) once, before any worker starts, so they do not race to write it; `run_batches` streams
finished batches back to the caller as they complete. Each batch is one Ray Data block and one
`LLM.generate` call, so batches stay the size the engine was given (`--batch-size`, by default the
engine's `max_batch`), and the engine's continuous batching fills its KV slots within it."""
from __future__ import annotations

import logging
import os
from pathlib import Path

from specmoe.errors import InputError
from specmoe.integrations import require
from specmoe.integrations.predictor import SpecMoEPredictor

__all__ = ["SpecMoEPredictor", "connect", "local_runtime_env", "prepare", "require_ray", "run_batches", "shutdown"]


def require_ray():
    """The ray module (with Ray Data), or MissingExtraError with the install hint."""
    require("ray.data", "ray", "running on Ray workers (--num-workers 0 runs in this process without Ray)")
    import ray
    return ray



def local_runtime_env() -> dict:
    """Workers of a local instance import the same specmoe as this process (a checkout or an install)."""
    import specmoe
    here = str(Path(specmoe.__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    return {"env_vars": {"PYTHONPATH": path}}


def connect(address: str | None = None, *, num_cpus: int | None = None) -> bool:
    """Join the cluster at `address`, or start a local Ray instance with `num_cpus` logical CPUs. Does
    nothing if Ray is already initialised in this process. True if this call connected (the caller shuts
    Ray down when done)."""
    ray = require_ray()
    if ray.is_initialized():
        return False
    # log_to_driver=False: workers' and raylets' log lines are not forwarded into this process's stdout, which
    # carries `specmoe batch --json`'s summary (a forwarded "(raylet) Task ... submit failed" line once landed
    # in it after an interrupted run); a worker's failure still reaches the caller as an error row or exception
    if address:
        try:
            ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False)
        except (ConnectionError, RuntimeError) as e:
            causes, c = [], e
            while c is not None:
                causes.append(str(c).splitlines()[0] if str(c) else type(c).__name__)
                c = c.__cause__
            hint = ("; the cluster uses token authentication (ray start's default): set RAY_AUTH_MODE=token here, "
                    "with its token in ~/.ray/auth_token or RAY_AUTH_TOKEN") if "auth" in " ".join(causes).lower() else ""
            raise InputError(f"cannot join the Ray cluster at {address}: {causes[0]}{hint}") from None
    else:
        # "local": a new instance even where `ray start` left a cluster address behind
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, logging_level=logging.WARNING,
                 log_to_driver=False, runtime_env=local_runtime_env())
    return True


def shutdown() -> None:
    require_ray().shutdown()


def prepare(llm: dict, progress: bool = True) -> None:
    """Build the read-only state the workers share before they start: with offload="disk", the expert
    repack (in repack_dir, or next to the checkpoint; put either on storage every machine sees)."""
    if llm.get("offload") != "disk":
        return
    from specmoe.engine.llm import default_model_path
    from specmoe.experts.formats import ExpertShape, make_format
    from specmoe.experts.repack import open_repack
    from specmoe.weights.checkpoint import Checkpoint
    ckpt = Checkpoint(Path(llm["model"]) if llm.get("model") else default_model_path())
    # the repack holds the storage format (the checkpoint's dtype, or int8 / int4), whatever the compute dtype
    fmt = make_format(llm.get("expert_format", "checkpoint"), ExpertShape.of(ckpt.config), ckpt.storage_dtype)
    open_repack(ckpt, fmt, llm.get("repack_dir"), progress=progress)


def work_schema():
    import pyarrow as pa
    return pa.schema([("index", pa.int64()), ("request", pa.string()), ("bad", pa.string())])


def run_batches(batches: list[list[dict]], *, llm: dict, defaults: dict, num_workers: int,
                cpus_per_worker: float = 1, gpus_per_worker: float = 0):
    """Yield the predictor's output rows of each batch of work rows, as batches finish (any order)."""
    ray = require_ray()
    import pyarrow as pa
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # the caller shows progress over rows
    ctx.print_on_execution_start = False
    logging.getLogger("ray.data").setLevel(logging.WARNING)
    ds = ray.data.from_arrow([pa.Table.from_pylist(b, schema=work_schema()) for b in batches])
    # one batch running and one queued per worker: busy without a long queue behind a slow worker
    pool = ray.data.ActorPoolStrategy(size=num_workers, max_tasks_in_flight_per_actor=2)
    out = ds.map_batches(SpecMoEPredictor, fn_constructor_kwargs={"llm": llm, "defaults": defaults},
                         batch_size=None, batch_format="pyarrow", compute=pool,
                         num_cpus=cpus_per_worker, num_gpus=gpus_per_worker or None)
    for table in out.iter_batches(batch_size=None, batch_format="pyarrow"):
        yield table.to_pylist()
