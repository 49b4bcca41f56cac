"""One llama.cpp run of benchmarks/over_ram.py, in a fresh process:

    python specmoe/bench/llama_child.py SPEC_JSON

loads the GGUF with llama-cpp-python's defaults (mmap), `spec["threads"]` threads, and produces spec["max_tokens"]
tokens after spec["prompt"] (token ids) through `peers._LlamaCpp`'s model and context, timed token by token
(sysprobe.Timeline); prints overram_runs.RESULT_TAG + its JSON result. spec["workload"]:
- "greedy": argmax tokens;
- "natural-forced": the prompt is evaluated, then every token of spec["forced"] alone, one llama_decode each
  (output token i is forced[i]); the argmax at each position is recorded too (how often the model agrees with the
  document);
- "sampled": softmax(logits / spec["temperature"]) sampled by numpy's generator seeded with spec["seed"] (its own
  random stream: its tokens are not specmoe's).
The bytes the process read while loading (/proc/self/io) are recorded apart (`load_read_bytes`), outside the
timeline.

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


def decode_one_at_a_time(eng, prompt: list[int], n: int, pick, on_token) -> tuple[list[int], list[int]]:
    """The prompt in one llama_decode, then n tokens one llama_decode each; token i = pick(i, logits).
    Returns (tokens, argmax at each position)."""
    import ctypes

    import numpy as np
    L, ctx = eng.lib, eng.ctx
    L.llama_memory_clear(L.llama_get_memory(ctx), True)
    batch = L.llama_batch_init(max(len(prompt), 1), 0, 1)
    toks, argmax = [], []

    def submit(items):  # [(token, pos, want_logits)]
        batch.n_tokens = len(items)
        for i, (tok, pos, lg) in enumerate(items):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
            batch.seq_id[i][0], batch.logits[i] = 0, lg
        rc = L.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")
    try:
        submit([(t, j, j == len(prompt) - 1) for j, t in enumerate(prompt)])
        row = len(prompt) - 1
        for i in range(n):
            ptr = L.llama_get_logits_ith(ctx, row)
            logits = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(eng.n_vocab,))
            argmax.append(int(logits.argmax()))
            toks.append(int(pick(i, logits)))
            on_token(i + 1)
            if i == n - 1:
                break
            submit([(toks[-1], len(prompt) + i, True)])
            row = 0
    finally:
        L.llama_batch_free(batch)
    return toks, argmax


def sampler(spec: dict):
    """pick(i, logits) for spec's workload (see the module docstring)."""
    import numpy as np
    w = spec.get("workload", "greedy")
    if w == "natural-forced":
        forced = list(spec["forced"])
        return lambda i, logits: forced[i]
    if w == "sampled":
        rng, temp = np.random.default_rng(spec["seed"]), float(spec["temperature"])

        def pick(i, logits):
            z = logits.astype(np.float64) / temp
            p = np.exp(z - z.max())
            return int(rng.choice(len(p), p=p / p.sum()))
        return pick
    return lambda i, logits: int(logits.argmax())


def main(argv: list[str]) -> int:
    spec = json.loads(argv[0])
    peers, probe = _load("peers"), _load("sysprobe")
    import llama_cpp
    t0 = time.perf_counter()
    plen = max(len(d["prompt"]) for d in spec["docs"])
    eng = peers._LlamaCpp(Path(spec["gguf"]), n_ctx_seq=plen + spec["max_tokens"] + 8, max_batch=1,
                          max_prompt_tokens=plen, threads=spec["threads"])
    load_s = time.perf_counter() - t0
    load_read = probe.proc_io()["read_bytes"]
    per, toks_all, agree = [], [], 0
    for doc in spec["docs"]:  # one document after another, batch 1, the KV cache cleared in between
        one = {**spec, **doc}
        tl = probe.Timeline()
        tl.start()
        toks, argmax = decode_one_at_a_time(eng, list(doc["prompt"]), spec["max_tokens"], sampler(one), tl.mark)
        per.append(tl.summary(spec["window"]))
        toks_all.append(toks)
        agree += sum(a == t for a, t in zip(argmax, toks))
    res = {"load_s": load_s, "load_read_bytes": load_read, "token_ids": toks_all, **probe.combine(per),
           "argmax_agrees_with_tokens": agree, "of": sum(len(t) for t in toks_all),
           "routing_windows": {"not_observed": "llama.cpp's routing is not observable from llama-cpp-python"},
           "version": getattr(llama_cpp, "__version__", "?"),
           "model_params": _params(llama_cpp), "torch_imported": "torch" in sys.modules,
           "status_at_end": probe.proc_status(), "io_at_end": probe.proc_io()}
    eng.close()
    print(RESULT_TAG + json.dumps(res), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
