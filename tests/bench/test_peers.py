"""The llama.cpp peer (`peers.run_llama`) without llama.cpp: a fake llama-cpp-python source distribution whose
convert_hf_to_gguf.py records the command it was run with, and a fake `llama_cpp` module whose low-level API
runs a known rule (next token = a function of the sequence so far) and checks the batches it is given (positions
consecutive per sequence, logits asked where read, the batch within the context's capacity). What is checked:
the converter's command line and the shim around it, the GGUF cache, the context sizing, the batched greedy
decode read back from the logits, the rows (tokens, reference match, GGUF info) and the error rows."""
from __future__ import annotations

import ctypes
import json
import sys
import tarfile
import types
from types import SimpleNamespace

import pytest

from specmoe.bench import peers

V = 64  # the fake model's vocabulary


def next_token(tokens: list[int]) -> int:
    return (7 * sum(tokens) + 3 * len(tokens)) % V


def greedy(prompt: list[int], n: int) -> list[int]:
    seq, out = list(prompt), []
    for _ in range(n):
        out.append(next_token(seq))
        seq.append(out[-1])
    return out


CONVERTER = r'''
import json, sys
from pathlib import Path
from conversion.base import TextModel
log = Path(__file__).parent / "calls.jsonl"
with log.open("a") as f:
    f.write(json.dumps(sys.argv) + "\n")
pre = TextModel().get_vocab_base_pre(None)  # unknown to llama.cpp: the shim answers "default"
if "--fail" in open(Path(sys.argv[1]) / "config.json").read():
    sys.exit("planted converter failure")
out = Path(sys.argv[sys.argv.index("--outfile") + 1])
out.write_text(json.dumps({"fake_gguf_of": sys.argv[1], "pre": pre}))
print("converted")
'''
BASE = '''
class TextModel:
    def get_vocab_base_pre(self, tokenizer):
        raise NotImplementedError("BPE pre-tokenizer was not recognized")
'''


def fake_sdist(cache_dir, *, as_tar: bool):
    """llama_cpp_python-0.0.0 with vendor/llama.cpp/{convert_hf_to_gguf.py, conversion/base.py, gguf-py/}."""
    root = cache_dir / "src" / "llama_cpp_python-0.0.0"
    vendor = root / "vendor" / "llama.cpp"
    (vendor / "conversion").mkdir(parents=True)
    (vendor / "gguf-py").mkdir()
    (vendor / "convert_hf_to_gguf.py").write_text(CONVERTER)
    (vendor / "conversion" / "__init__.py").write_text("")
    (vendor / "conversion" / "base.py").write_text(BASE)
    if not as_tar:
        return root
    tar = cache_dir / "llama_cpp_python-0.0.0.tar.gz"
    with tarfile.open(tar, "w:gz") as tf:
        tf.add(root, arcname=root.name)
    return tar


class FakeLlamaCpp(types.ModuleType):
    """The part of llama-cpp-python's low-level API `peers._LlamaCpp` uses, over `next_token`."""
    __version__ = "0.0-fake"

    def __init__(self):
        super().__init__("llama_cpp")
        self.contexts = []
        self.freed = []

    def llama_backend_init(self):
        pass

    def llama_model_default_params(self):
        return SimpleNamespace()

    def llama_model_load_from_file(self, path: bytes, params):
        return SimpleNamespace(path=path.decode())

    def llama_context_default_params(self):
        return SimpleNamespace(n_seq_max=1, n_ctx=512, n_batch=512, n_ubatch=512, n_threads=4, n_threads_batch=4,
                               kv_unified=False)

    def llama_init_from_model(self, model, p):
        ctx = SimpleNamespace(model=model, params=p, kv={}, rows={}, decodes=0)
        self.contexts.append(ctx)
        return ctx

    def llama_model_get_vocab(self, model):
        return model

    def llama_vocab_n_tokens(self, vocab):
        return V

    def llama_get_memory(self, ctx):
        return ctx

    def llama_memory_clear(self, mem, data: bool):
        mem.kv.clear()

    def llama_batch_init(self, n_tokens: int, embd: int, n_seq_max: int):
        return SimpleNamespace(n_tokens=0, cap=n_tokens, token=[0] * n_tokens, pos=[0] * n_tokens,
                               n_seq_id=[0] * n_tokens, seq_id=[[0] for _ in range(n_tokens)],
                               logits=[False] * n_tokens)

    def llama_batch_free(self, batch):
        self.freed.append(batch)

    def llama_decode(self, ctx, batch) -> int:
        p = ctx.params
        assert batch.n_tokens <= min(batch.cap, p.n_batch), "a batch past the context's capacity"
        ctx.rows, ctx.decodes = {}, ctx.decodes + 1
        for i in range(batch.n_tokens):
            assert batch.n_seq_id[i] == 1
            seq = batch.seq_id[i][0]
            assert 0 <= seq < p.n_seq_max, f"sequence id {seq} past n_seq_max {p.n_seq_max}"
            kv = ctx.kv.setdefault(seq, [])
            assert batch.pos[i] == len(kv), f"sequence {seq}: position {batch.pos[i]} after {len(kv)} tokens"
            kv.append(batch.token[i])
            assert sum(map(len, ctx.kv.values())) <= p.n_ctx, "the context is full"
            if batch.logits[i]:
                row = (ctypes.c_float * V)(*([0.0] * V))
                row[next_token(kv)] = 1.0
                ctx.rows[i] = row
        return 0

    def llama_get_logits_ith(self, ctx, i: int):
        assert i in ctx.rows, f"logits of batch row {i} were not asked for"
        return ctypes.cast(ctx.rows[i], ctypes.POINTER(ctypes.c_float))

    def llama_free(self, ctx):
        ctx.closed = True

    def llama_model_free(self, model):
        model.closed = True


@pytest.fixture
def fake_llama(monkeypatch):
    mod = FakeLlamaCpp()
    monkeypatch.setitem(sys.modules, "llama_cpp", mod)
    return mod


PROMPTS = [[5, 9, 11, 2], [1, 2, 3], [40, 41, 42, 43, 44], [7]]


@pytest.mark.parametrize("as_tar", [True, False])
def test_run_llama_converts_once_and_decodes_batched_greedy(tiny_ckpt, tmp_path, fake_llama, as_tar):
    path = tiny_ckpt("qwen3_moe")
    cache = tmp_path / "cache"
    cache.mkdir()
    src = fake_sdist(cache, as_tar=as_tar)
    batches, n = (1, 3), 5
    refs = {("main", b, n): [greedy(p, n) for p in PROMPTS[:b]] for b in batches}
    rows = peers.run_llama(path, PROMPTS, batches, n, refs, cache, str(src), threads=3)

    # the converter: run once, through the shim, with the checkpoint, a temporary outfile and bf16
    script_dir = (cache / "llama_cpp_python-0.0.0" if as_tar else src) / "vendor" / "llama.cpp"
    calls = [json.loads(line) for line in (script_dir / "calls.jsonl").read_text().splitlines()]
    assert len(calls) == 1
    argv = calls[0]
    assert argv[0] == str(script_dir / "convert_hf_to_gguf.py") and argv[1] == str(path)
    assert argv[2] == "--outfile" and argv[3].endswith(".bf16.tmp") and argv[4:] == ["--outtype", "bf16"]
    gguf = rows[0]["gguf"]
    assert gguf["gguf"].endswith(".bf16.gguf") and json.loads(open(gguf["gguf"]).read()) == {
        "fake_gguf_of": str(path), "pre": "default"}
    assert gguf["pretokenizer_patched"] and "converted" in gguf["convert_log_tail"]

    # the context: one sequence id per prompt of the largest batch, room for prompt + n (+8) each
    ctx = fake_llama.contexts[0]
    assert ctx.params.n_seq_max == 3 and ctx.params.n_ctx == (5 + n + 8) * 3
    assert ctx.params.n_threads == ctx.params.n_threads_batch == 3 and ctx.params.kv_unified
    assert ctx.closed and ctx.model.closed and fake_llama.freed, "context, model and batches are freed"

    # the rows: what llama.cpp's logits say, matching the reference
    assert [r["batch"] for r in rows] == list(batches)
    for r in rows:
        assert r["status"] == "ok" and r["generated_tokens"] == r["batch"] * n
        assert r["matches_reference"] == 1.0 and r["version"] == "0.0-fake"
    eng = peers._LlamaCpp(gguf["gguf"], n_ctx_seq=20, max_batch=4, max_prompt_tokens=13, threads=1)
    _, toks = eng.generate(PROMPTS, n)
    assert toks == [greedy(p, n) for p in PROMPTS]

    # a second run reuses the GGUF: no conversion
    again = peers.run_llama(path, PROMPTS, (1,), n, refs, cache, str(src), threads=1)
    assert again[0]["gguf"]["reused"] and len((script_dir / "calls.jsonl").read_text().splitlines()) == 1


def test_a_wrong_token_is_seen_in_the_reference_match(tiny_ckpt, tmp_path, fake_llama):
    """The rows compare llama.cpp's tokens with the reference: a reference that differs is not a match."""
    cache = tmp_path / "cache"
    cache.mkdir()
    src = fake_sdist(cache, as_tar=False)
    refs = {("main", 2, 3): [greedy(PROMPTS[0], 3), [t + 1 for t in greedy(PROMPTS[1], 3)]]}
    rows = peers.run_llama(tiny_ckpt("qwen3_moe"), PROMPTS, (2,), 3, refs, cache, str(src), threads=1)
    assert rows[0]["matches_reference"] == 0.5


def peer_cfg(cache, src):
    return SimpleNamespace(peers=("llama.cpp",), peer_batches=(1, 2), peer_max_tokens=3, max_tokens=3,
                           dtype="float32", cache_dir=str(cache), llama_cpp_src=str(src), threads=1)


def test_a_failing_converter_is_an_error_row(tiny_ckpt, tmp_path, fake_llama):
    import shutil
    path = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt("qwen3_moe"), path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "note": "--fail"}))
    cache = tmp_path / "cache"
    cache.mkdir()
    src = fake_sdist(cache, as_tar=False)
    rows = peers.run_peers(peer_cfg(cache, src), path, PROMPTS, out=tmp_path, refs={},
                           minfo={"dtype": "float32"}, out_of_time=lambda: False)
    assert [r["status"] for r in rows] == ["error", "error"]
    assert "convert_hf_to_gguf.py failed (rc 1)" in rows[0]["reason"] and "planted converter failure" in rows[0][
        "reason"]


def test_without_llama_cpp_the_rows_say_unavailable(tiny_ckpt, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp raises ImportError
    rows = peers.run_peers(peer_cfg(tmp_path, tmp_path), tiny_ckpt("qwen3_moe"), PROMPTS, out=tmp_path, refs={},
                           minfo={"dtype": "float32"}, out_of_time=lambda: False)
    assert [r["status"] for r in rows] == ["unavailable", "unavailable"]
    assert "llama-cpp-python is not installed" in rows[0]["reason"]


def test_no_convert_script_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="convert_hf_to_gguf.py not found: `pip download"):
        peers.find_convert_script(tmp_path, None)
