"""One llama.cpp run of benchmarks/over_ram.py, in a fresh process:

    python specmoe/bench/llama_child.py SPEC_JSON

loads the GGUF with llama-cpp-python's defaults (mmap), `spec["threads"]` threads, and generates spec["max_tokens"]
greedy tokens after spec["prompt"] (token ids) through `peers._LlamaCpp`, timed token by token
(sysprobe.Timeline); prints overram_runs.RESULT_TAG + its JSON result.

It imports neither torch nor the specmoe package (whose __init__ imports torch): `peers.py` and `sysprobe.py`
import only the standard library and are loaded from their files, so the process's footprint is llama.cpp's.
"""
from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path

RESULT_TAG = "OVERRAM-RESULT "  # = overram_runs.RESULT_TAG (not imported: see the module docstring)


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"_overram_{name}", Path(__file__).with_name(f"{name}.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up here
    spec.loader.exec_module(mod)
    return mod


def _params(llama_cpp) -> dict:
    """The default model parameters that decide how weights are read (0.3.36: load_mode -1 = auto, mmap on a CPU;
    older versions: use_mmap)."""
    p = llama_cpp.llama_model_default_params()
    names = {f[0] for f in p._fields_}
    return {k: getattr(p, k) for k in ("use_mmap", "use_mlock", "load_mode", "lazy_mode", "use_extra_bufts")
            if k in names}


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    peers, probe = _load("peers"), _load("sysprobe")
    import llama_cpp
    t0 = time.perf_counter()
    eng = peers._LlamaCpp(Path(spec["gguf"]), n_ctx_seq=len(spec["prompt"]) + spec["max_tokens"] + 8, max_batch=1,
                          max_prompt_tokens=len(spec["prompt"]), threads=spec["threads"])
    load_s = time.perf_counter() - t0
    tl = probe.Timeline()
    tl.start()
    _, out = eng.generate([list(spec["prompt"])], spec["max_tokens"], on_token=tl.mark)
    res = {"load_s": load_s, "token_ids": out[0], **tl.summary(spec["window"]),
           "version": getattr(llama_cpp, "__version__", "?"),
           "model_params": _params(llama_cpp), "torch_imported": "torch" in sys.modules,
           "status_at_end": probe.proc_status(), "io_at_end": probe.proc_io()}
    eng.close()
    print(RESULT_TAG + json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
