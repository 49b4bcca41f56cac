"""Bounded memory: a KV cache sized by the admitted requests (grown in blocks), an expert budget that
counts everything the offloader and the draft allocate, and `llm.stats["memory"]`. RSS figures come
from a fresh subprocess (RssAnon of /proc/self/status), so other tests do not pollute them."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import specmoe
import specmoe.models.kv_cache as kv_cache
from specmoe import LLM, SamplingParams
from specmoe.errors import MemoryBudgetError

ROOT = Path(specmoe.__file__).resolve().parents[1]
MiB = 2**20


def kv_bytes(layers: int, kv_heads: int, head_dim: int, dtype, slots: int, positions: int) -> int:
    """Keys + values of `slots` × `positions` (written out here, not imported: the test checks the engine)."""
    return 2 * layers * slots * positions * kv_heads * head_dim * dtype.itemsize


def run_measured(body: str) -> dict:
    """Run `body` in a fresh interpreter; it has `rss()` (anonymous resident bytes) and sets `out` (a dict)."""
    script = textwrap.dedent("""
        import json, torch
        torch.set_num_threads(1)
        def rss():
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("RssAnon:"):
                        return int(line.split()[1]) * 1024
        out = {}
    """) + textwrap.dedent(body) + "\nprint('RESULT' + json.dumps(out))\n"
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    line = [ln for ln in res.stdout.splitlines() if ln.startswith("RESULT")][-1]
    return json.loads(line[len("RESULT"):])


# ------------------------------------------------------------------ KV cache
def test_kv_cache_of_one_long_prompt_is_small():
    """One 900-token prompt on the demo model: main allocated 256 slots × the context (~680 MiB)."""
    out = run_measured("""
        from specmoe import LLM, SamplingParams
        llm = LLM()
        llm.generate([[5, 6]], SamplingParams(max_tokens=2, ignore_eos=True))  # warm-up: allocator, kernels
        r0 = rss()
        llm.generate([[5] * 900], SamplingParams(max_tokens=8, ignore_eos=True))
        out["rss_delta"] = rss() - r0
        out["kv"] = llm._cache.nbytes
        out["slots"], out["positions"] = llm._cache.max_batch, llm._cache.max_seq
        cfg = llm.config
        out["cfg"] = [cfg.num_layers, cfg.num_kv_heads, cfg.head_dim]
    """)
    L, H, Dh = out["cfg"]
    import torch
    assert out["slots"] == 1 and out["positions"] == 909  # 900 + 8 + lookahead: all this run can write
    assert out["kv"] == kv_bytes(L, H, Dh, torch.bfloat16, 1, 909) < 3 * MiB
    old = kv_bytes(L, H, Dh, torch.bfloat16, 256, 909)  # what main allocated for this request
    assert old > 600 * MiB
    # the rest of the delta is the 900-token prefill's activations (measured ~60 MiB), not the cache
    assert out["rss_delta"] < 150 * MiB, out


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one intra-op thread is faster on a shared, busy CPU."""
    import torch
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def ckpt(tiny_ckpt):
    return tiny_ckpt("qwen3_moe")


def _generate_counting_growth(llm, prompts, params, monkeypatch, block):
    """Generate with positions allocated in blocks of `block`; returns (token lists, KV growths)."""
    monkeypatch.setattr(kv_cache, "BLOCK", block, raising=False)
    grown = []
    reserve = getattr(kv_cache.KVCache, "reserve", None)  # (main had no growth: nothing to count)

    def counting(self, slots, positions):
        before = (self.max_batch, self.max_seq)
        reserve(self, slots, positions)
        if before != (0, 0) and before != (self.max_batch, self.max_seq):
            grown.append((before, (self.max_batch, self.max_seq)))
    if reserve is not None:
        monkeypatch.setattr(kv_cache.KVCache, "reserve", counting)
    llm._cache = None
    toks = [o.token_ids for o in llm.generate(prompts, params)]
    monkeypatch.undo()
    return toks, grown


@pytest.mark.parametrize("decoding", ["ar", "specmoe"])
def test_kv_growth_mid_generation_keeps_outputs(ckpt, monkeypatch, decoding):
    """Positions grow block by block while sequences decode (ragged prompts, requests joining freed slots);
    greedy tokens equal a run whose cache is allocated once at full size."""
    llm = LLM(ckpt, dtype="float32", max_batch=3, decoding=decoding, draft_experts=3, num_draft_tokens=3,
              substitution="mask")
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11], [12, 13, 14, 15], [16, 17]]
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (20, 8, 24, 14, 6)]
    ref, grown_ref = _generate_counting_growth(llm, prompts, params, monkeypatch, 10**6)
    assert grown_ref == []  # one allocation of the whole run's positions
    toks, grown = _generate_counting_growth(llm, prompts, params, monkeypatch, 4)
    assert len(grown) >= 4, grown  # the cache grew several times, mid-generation
    assert toks == ref
    assert llm._cache.max_batch == 3  # min(max_batch, requests): never max_batch × the context up front


def test_kv_slots_follow_the_requests(ckpt):
    llm = LLM(ckpt, dtype="float32")  # max_batch=256
    llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert llm._cache.max_batch == 2
    llm.generate([[1, 2, 3]] * 5, SamplingParams(max_tokens=4, ignore_eos=True))
    assert llm._cache.max_batch == 5
    llm.logits([[1, 2, 3]])  # a much smaller request does not keep the larger cache alive
    assert llm._cache.max_batch == 1 and llm._cache.max_seq == 3


def test_kv_request_that_cannot_fit_is_refused(ckpt, monkeypatch):
    import specmoe.experts.memory as memory
    llm = LLM(ckpt, dtype="float32")
    cfg = llm.config
    one = kv_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, llm.dtype, 1, 200 + 50 + 1)
    monkeypatch.setattr(memory, "host_memory", lambda: (10 * one, one - 1))  # machine total, available now
    with pytest.raises(MemoryBudgetError, match=r"KV cache of request 1 \(200 prompt \+ 50 max_tokens \+ 1 "
                                                r"lookahead = 251 positions .* only .* available"):
        llm.generate([[1, 2], [3] * 200], SamplingParams(max_tokens=50))
    monkeypatch.setattr(memory, "host_memory", lambda: (10 * one, 10 * one))
    assert len(llm.generate([[1, 2], [3] * 200], SamplingParams(max_tokens=50))) == 2
