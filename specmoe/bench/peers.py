"""Peers on the same model, the same prompt token ids and the same number of generated
tokens (greedy, EOS ignored): HF transformers `generate` with every weight resident, HF
transformers + Accelerate disk offload, and llama.cpp (llama-cpp-python, GGUF converted
from the same checkpoint). Each peer is optional: when its package or a build step is
missing, the row says exactly why instead of holding a number.

Prompts go in as token ids everywhere, so tokenizer conversion never changes the input.
"""
from __future__ import annotations

import gc
import json
import subprocess
import sys
import tarfile
import time
import traceback
from pathlib import Path

PEERS = {
    "hf": "HF transformers generate (all weights resident)",
    "hf-offload": "HF transformers + Accelerate disk offload (experts on 'disk', offload_folder)",
    "llama.cpp": "llama.cpp via llama-cpp-python (CPU, GGUF of the same checkpoint)",
}


def _left_pad(prompts: list[list[int]], pad: int):
    import torch
    T = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (T - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (T - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def _hf_generate(model, prompts, n):
    import torch
    ids, mask = _left_pad(prompts, 0)
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0, eos_token_id=None)
        wall = time.perf_counter() - t0
    return wall, [row[ids.shape[1]:].tolist() for row in out]


def _timed_rows(peer, gen_fn, prompts, batches, n, refs) -> list[dict]:
    """Per batch: one generate of n tokens and one of 1 token (prefill), so decode = the difference."""
    rows = []
    gen_fn(prompts[:1], 2)  # warm-up
    for b in batches:
        p = prompts[:b]
        wall1, _ = gen_fn(p, 1)
        wall, toks = gen_fn(p, n)
        row = {"peer": peer, "label": PEERS[peer], "batch": b, "status": "ok", "generated_tokens": b * n,
               "wall_s": wall, "tokens_per_s": b * n / wall, "prefill_wall_s": wall1,
               "decode_tokens_per_s": b * (n - 1) / (wall - wall1) if wall > wall1 and n > 1 else None}
        ref = next((v for (tag, bb, T), v in sorted(refs.items()) if tag == "main" and bb == b and T >= n), None)
        if ref is not None:
            row["matches_reference"] = sum(t == r[:n] for t, r in zip(toks, ref)) / b
        rows.append(row)
    return rows


def run_hf(path: Path, prompts, batches, n, refs, dtype) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.bfloat16).eval()
    try:
        return _timed_rows("hf", lambda p, k: _hf_generate(model, p, k), prompts, batches, n, refs)
    finally:
        del model
        gc.collect()


def offload_device_map(path: Path) -> dict:
    """Non-expert modules on the CPU, every layer's experts module on 'disk'."""
    raw = json.loads((path / "config.json").read_text())
    dm = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    for i in range(raw["num_hidden_layers"]):
        p = f"model.layers.{i}."
        dm.update({p + "self_attn": "cpu", p + "input_layernorm": "cpu", p + "post_attention_layernorm": "cpu",
                   p + "mlp.gate": "cpu", p + "mlp.experts": "disk"})
    return dm


def run_hf_offload(path: Path, prompts, batches, n, refs, dtype, folder: Path) -> list[dict]:
    import torch
    from transformers import AutoModelForCausalLM
    folder.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.bfloat16, device_map=offload_device_map(path),
                                                 offload_folder=str(folder)).eval()
    try:
        rows = _timed_rows("hf-offload", lambda p, k: _hf_generate(model, p, k), prompts, batches, n, refs)
        for r in rows:
            r["note"] = ("Accelerate hooks load each experts module from np.memmap files in offload_folder per "
                         "forward (reads go through the OS page cache)")
        return rows
    finally:
        del model
        gc.collect()


# ---------------------------------------------------------------- llama.cpp
def find_convert_script(cache_dir: Path, src: str | None) -> Path:
    """convert_hf_to_gguf.py from llama-cpp-python's source distribution (vendor/llama.cpp)."""
    cands = []
    if src:
        cands.append(Path(src))
    cands += sorted(cache_dir.glob("llama_cpp_python-*"))
    for c in cands:
        if c.is_file() and c.name.endswith(".tar.gz"):
            dest = cache_dir / c.name[: -len(".tar.gz")]
            if not (dest / "vendor" / "llama.cpp" / "conversion").exists():
                with tarfile.open(c) as tf:
                    py = ("/vendor/llama.cpp/convert_hf_to_gguf.py", "/vendor/llama.cpp/conversion/",
                          "/vendor/llama.cpp/gguf-py/")
                    members = [m for m in tf.getmembers() if any(k in m.name for k in py)]
                    tf.extractall(cache_dir, members=members, filter="data")
            c = dest
        script = c / "vendor" / "llama.cpp" / "convert_hf_to_gguf.py"
        if script.is_file():
            return script
    raise FileNotFoundError(
        "convert_hf_to_gguf.py not found: `pip download --no-binary :all: --no-deps llama-cpp-python -d "
        f"{cache_dir}` (or pass --llama-cpp-src PATH to the sdist)")


# The demo model's tokenizer is our own byte-level BPE, whose pre-tokenizer hash llama.cpp's
# converter does not know; prompts go in as token ids, so the pre-tokenizer name is never used.
_CONVERT_SHIM = r"""
import runpy, sys
from pathlib import Path
script = sys.argv[1]
sys.argv = [script] + sys.argv[2:]
here = Path(script).parent
sys.path[:0] = [str(here), str(here / 'gguf-py')]
try:
    from conversion.base import TextModel
except ImportError:  # older layouts keep TextModel in the script itself
    TextModel = None
if TextModel is not None:
    orig = TextModel.get_vocab_base_pre
    def pre(self, tokenizer):
        try:
            return orig(self, tokenizer)
        except NotImplementedError:
            print('specmoe-bench: unknown BPE pre-tokenizer, using "default" (prompts are passed as token ids)')
            return 'default'
    TextModel.get_vocab_base_pre = pre
runpy.run_path(script, run_name='__main__')
"""


def gguf_path(path: Path, cache_dir: Path, outtype: str = "bf16") -> Path:
    """Where `convert_gguf` puts (or finds) the GGUF of checkpoint `path` in `outtype` (bf16, q8_0)."""
    from specmoe.weights.checkpoint import Checkpoint
    import hashlib
    tag = hashlib.sha1(Checkpoint(path).fingerprint().encode()).hexdigest()[:10]
    return cache_dir / f"{path.name}-{tag}.{outtype}.gguf"


def convert_gguf(path: Path, cache_dir: Path, src: str | None, *, timeout: float = 900,
                 outtype: str = "bf16") -> tuple[Path, dict]:
    """The GGUF of checkpoint `path` in `cache_dir` (`outtype` bf16, or q8_0: llama.cpp's 8-bit blocks of 32 with one
    fp16 scale each), converted once by llama.cpp's convert_hf_to_gguf.py (`timeout` seconds at most; a partial
    output is removed)."""
    out = gguf_path(path, cache_dir, outtype)
    info = {"gguf": str(out), "outtype": outtype}
    if out.is_file():
        return out, {**info, "reused": True}
    script = find_convert_script(cache_dir, src)
    tmp = out.with_suffix(".tmp")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run([sys.executable, "-c", _CONVERT_SHIM, str(script), str(path), "--outfile", str(tmp),
                               "--outtype", outtype], capture_output=True, text=True, timeout=timeout)
    except BaseException:  # the timeout and Ctrl-C included: never leave a partial GGUF behind
        tmp.unlink(missing_ok=True)
        raise
    info["convert_log_tail"] = (proc.stdout + proc.stderr)[-1500:]
    info["convert_s"] = time.perf_counter() - t0
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"convert_hf_to_gguf.py failed (rc {proc.returncode}): {(proc.stderr or proc.stdout)[-600:]}")
    tmp.rename(out)
    info["pretokenizer_patched"] = "unknown BPE pre-tokenizer" in proc.stdout
    return out, info


class _LlamaCpp:
    """A llama.cpp model + context through llama-cpp-python's low-level API, sized for `max_batch`
    parallel sequences (the high-level `Llama` runs one sequence at a time)."""

    def __init__(self, gguf: Path, *, n_ctx_seq: int, max_batch: int, max_prompt_tokens: int, threads: int):
        import llama_cpp
        self.lib = llama_cpp
        llama_cpp.llama_backend_init()
        self.model = llama_cpp.llama_model_load_from_file(str(gguf).encode(), llama_cpp.llama_model_default_params())
        assert self.model, f"llama.cpp could not load {gguf}"
        p = llama_cpp.llama_context_default_params()
        p.n_seq_max = max_batch
        p.n_ctx = n_ctx_seq * max_batch
        p.n_batch = max(max_prompt_tokens, max_batch, 512)
        p.n_ubatch = min(p.n_batch, 512)
        p.n_threads = p.n_threads_batch = threads
        if hasattr(p, "kv_unified"):
            p.kv_unified = True
        self.ctx = llama_cpp.llama_init_from_model(self.model, p)
        assert self.ctx, "llama.cpp could not create a context"
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        self.cap = p.n_batch

    def close(self) -> None:
        self.lib.llama_free(self.ctx)
        self.lib.llama_model_free(self.model)

    def generate(self, prompts: list[list[int]], n: int, on_token=None):
        """Batched greedy decode: one llama_batch, one sequence id per prompt. `on_token(k)` is called once the
        k-th token of every sequence is known (k = 1..n; for per-token timing)."""
        import ctypes

        import numpy as np
        L, ctx = self.lib, self.ctx
        L.llama_memory_clear(L.llama_get_memory(ctx), True)
        B = len(prompts)
        batch = L.llama_batch_init(self.cap, 0, 1)
        out = [[] for _ in range(B)]
        try:
            def submit(items):  # [(token, pos, seq, want_logits)]
                batch.n_tokens = len(items)
                for i, (tok, pos, seq, lg) in enumerate(items):
                    batch.token[i], batch.pos[i], batch.n_seq_id[i] = tok, pos, 1
                    batch.seq_id[i][0], batch.logits[i] = seq, lg
                rc = L.llama_decode(ctx, batch)
                assert rc == 0, f"llama_decode returned {rc}"

            t0 = time.perf_counter()
            items = [(t, j, s, j == len(p) - 1) for s, p in enumerate(prompts) for j, t in enumerate(p)]
            assert len(items) <= self.cap, "prompts exceed the context's batch capacity"
            submit(items)
            rows = [i for i, it in enumerate(items) if it[3]]
            lens = [len(p) for p in prompts]
            for step in range(n):
                for s, i in enumerate(rows):
                    ptr = L.llama_get_logits_ith(ctx, i)
                    logits = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,))
                    out[s].append(int(logits.argmax()))
                if on_token is not None:
                    on_token(step + 1)
                if step == n - 1:
                    break
                submit([(out[s][-1], lens[s] + step, s, True) for s in range(B)])
                rows = list(range(B))
            wall = time.perf_counter() - t0
        finally:
            L.llama_batch_free(batch)
        return wall, out


def run_llama(path: Path, prompts, batches, n, refs, cache_dir: Path, src: str | None, threads: int) -> list[dict]:
    try:
        import llama_cpp
    except ImportError as e:
        raise ModuleNotFoundError(f"llama-cpp-python is not installed ({e})") from None
    gguf, info = convert_gguf(path, cache_dir, src)
    B = max(batches)
    eng = _LlamaCpp(gguf, n_ctx_seq=max(len(p) for p in prompts) + n + 8, max_batch=B,
                    max_prompt_tokens=sum(len(p) for p in prompts[:B]), threads=threads)
    try:
        rows = _timed_rows("llama.cpp", eng.generate, prompts, batches, n, refs)
        for r in rows:
            r["gguf"] = info
            r["version"] = getattr(llama_cpp, "__version__", "?")
            r["note"] = "bf16 GGUF, CPU backend, low-level batched API (one sequence id per prompt), greedy argmax"
        return rows
    finally:
        eng.close()


def run_peers(cfg, path: Path, prompts, *, out: Path, refs: dict, minfo: dict, out_of_time) -> list[dict]:
    import torch
    from specmoe.weights.checkpoint import resolve_dtype
    n = cfg.peer_max_tokens or cfg.max_tokens
    dtype = resolve_dtype(cfg.dtype, default=minfo["dtype"])
    cache_dir = Path(cfg.cache_dir) if cfg.cache_dir else Path.home() / ".cache" / "specmoe"
    cache_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for peer in cfg.peers:
        base = {"peer": peer, "label": PEERS.get(peer, peer), "max_tokens": n}
        if peer not in PEERS:
            rows.append({**base, "status": "error", "reason": f"unknown peer {peer!r}"})
            continue
        if out_of_time():
            rows += [{**base, "batch": b, "status": "skipped", "reason": "time budget of the preset exhausted"}
                     for b in cfg.peer_batches]
            continue
        try:
            if peer == "hf":
                got = run_hf(path, prompts, cfg.peer_batches, n, refs, dtype)
            elif peer == "hf-offload":
                got = run_hf_offload(path, prompts, cfg.peer_batches, n, refs, dtype, cache_dir / f"hf-offload-{path.name}")
            else:
                got = run_llama(path, prompts, cfg.peer_batches, n, refs, cache_dir, cfg.llama_cpp_src,
                                cfg.threads or torch.get_num_threads())
            rows += [{**base, **r} for r in got]
        except ModuleNotFoundError as e:
            rows += [{**base, "batch": b, "status": "unavailable", "reason": str(e)} for b in cfg.peer_batches]
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            rows += [{**base, "batch": b, "status": "error", "reason": f"{type(e).__name__}: {e}"}
                     for b in cfg.peer_batches]
    return rows
