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
from specmoe.errors import InputError, MemoryBudgetError
from specmoe.weights.checkpoint import Checkpoint

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
        out["dtype"] = str(llm.dtype).replace("torch.", "")  # auto: bf16, or fp32 where bf16 matmul is slow
    """)
    L, H, Dh = out["cfg"]
    import torch
    dt = getattr(torch, out["dtype"])
    assert out["slots"] == 1 and out["positions"] == 909  # 900 + 8 + lookahead: all this run can write
    assert out["kv"] == kv_bytes(L, H, Dh, dt, 1, 909) < 6 * MiB
    old = kv_bytes(L, H, Dh, dt, 256, 909)  # what main allocated for this request
    assert old > 600 * MiB
    # the rest of the delta is the 900-token prefill's activations (measured ~60 MiB), not the cache
    assert out["rss_delta"] < 150 * MiB, out


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny models run on one intra-op thread (the root conftest's `one_thread`)."""
    yield


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
    import specmoe.memory as memory
    llm = LLM(ckpt, dtype="float32")
    cfg = llm.config
    one = kv_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, llm.dtype, 1, 200 + 50 + 1)
    monkeypatch.setattr(memory, "host_memory", lambda: (10 * one, one - 1))  # machine total, available now
    with pytest.raises(MemoryBudgetError, match=r"KV cache of request 1 \(200 prompt \+ 50 max_tokens \+ 1 "
                                                r"lookahead = 251 positions .* only .* available"):
        llm.generate([[1, 2], [3] * 200], SamplingParams(max_tokens=50))
    monkeypatch.setattr(memory, "host_memory", lambda: (10 * one, 10 * one))
    assert len(llm.generate([[1, 2], [3] * 200], SamplingParams(max_tokens=50))) == 2


def test_kv_admits_only_what_memory_holds(ckpt, monkeypatch):
    """With free memory for 2 sequences at the run's full length, 5 requests run 2 at a time (the others
    wait for a free slot) instead of failing mid-run; outputs equal an unconstrained run."""
    import specmoe.memory as memory
    prompts = [[i + 1, i + 2, i + 3] for i in range(5)]
    sp = SamplingParams(max_tokens=20, ignore_eos=True)
    llm = LLM(ckpt, dtype="float32")
    free = [o.token_ids for o in llm.generate(prompts, sp)]
    assert llm._cache.max_batch == 5
    cfg = llm.config
    one = kv_bytes(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, llm.dtype, 1, 3 + 20 + 1)
    llm._cache = None
    monkeypatch.setattr(memory, "host_memory", lambda: (100 * one, 2 * one + one // 2))
    assert [o.token_ids for o in llm.generate(prompts, sp)] == free
    assert llm._cache.max_batch == 2


# ------------------------------------------------------------------ expert budget
def test_budget_too_small_for_top_k_draft_and_scratch_fails_at_construction(ckpt):
    """fp32 tiny qwen3_moe on disk: slot = expert = 9 KiB (CPU disk reads land in the tier's three 12 KiB
    staging rows), 3 MoE layers, top-k 2, E 8. The budget holds top-k slots + scratch without speculation,
    not the 4 slots SpecMoE's 4 pinned draft experts per layer need (main ran it)."""
    budget = 150_000
    with pytest.raises(MemoryBudgetError, match=r"memory_budget=0\.14 MiB is too small: 4 slots per layer \(top-k "
                                                r"is 2, 4 draft experts stay pinned\) need expert cache slots "
                                                r"0\.11 MiB \+ scratch 0\.02 MiB \+ staging 0\.04 MiB = 0\.16 MiB"):
        LLM(ckpt, dtype="float32", offload="disk", memory_budget=budget, decoding="specmoe", draft_experts=4, io_depth=1)
    ar = LLM(ckpt, dtype="float32", offload="disk", memory_budget=budget, io_depth=1)
    assert ar.stats["memory"]["experts_total"] <= budget
    with pytest.raises(InputError, match="fewer than the 2 \\(top-k\\)") as e:  # the slots, not the budget, are short
        LLM(ckpt, dtype="float32", offload="disk", memory_budget="1MiB", cache_experts=1)
    assert not isinstance(e.value, MemoryBudgetError)


def test_cache_bytes_bounds_the_working_set(ckpt):
    """cache_bytes=200 kB, host tier (slot = expert = 9 KiB, 3 MoE layers): 2 scratch rows come first, the
    slots take what is left: 6 per layer; the draft owns no memory of its own (its 4 experts are pinned in
    those slots and read in place)."""
    llm = LLM(ckpt, dtype="float32", offload="host", cache_bytes=200_000, decoding="specmoe", draft_experts=4)
    assert llm.store.slots == 6
    llm.generate([[1, 2, 3, 4]], SamplingParams(max_tokens=6, ignore_eos=True))
    m = llm.stats["memory"]
    working = m["expert_cache_slots"] + m["scratch"] + m["staging"]
    assert working <= 200_000 < working + 3 * 9216  # one more slot per layer would not fit
    for layer, ids in llm.stats["draft_set"].items():
        assert set(ids) <= llm.store.resident(layer), "the draft set lives in the slots"


@pytest.mark.parametrize("offload", ["none", "host", "disk"])
def test_memory_stats_add_up_and_match_allocations(ckpt, offload):
    """stats["memory"] parts equal what is really allocated (measured after draft-set refreshes)."""
    llm = LLM(ckpt, dtype="float32", offload=offload, decoding="specmoe", draft_experts=3, num_draft_tokens=3,
              **({} if offload == "none" else {"cache_experts": 3, "memory_budget": 2**20}))
    prompts = [[i % 90 + 1 for i in range(k, k + 40)] for k in range(4)]  # unions outgrow 3 slots
    llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    s = llm.stats
    m = s["memory"]
    parts = ("non_expert_weights", "resident_experts", "expert_cache_slots", "scratch", "staging", "host_tier",
             "kv_cache")
    assert m["total"] == sum(m[k] for k in parts)
    assert m["experts_total"] == m["total"] - m["non_expert_weights"] - m["kv_cache"]
    model = llm.model
    assert m["non_expert_weights"] == sum(p.numel() * p.element_size() for p in model.parameters())
    assert m["kv_cache"] == llm._cache.k.nbytes + llm._cache.v.nbytes
    assert s["draft_set_refreshes"] > 0
    p = llm.store
    if offload == "none":
        assert m["resident_experts"] == sum(t.nbytes for t in p.layers.values())
        assert m["expert_cache_slots"] == m["scratch"] == m["host_tier"] == 0
        return
    assert m["memory_budget"] == 2**20 and m["experts_total"] <= 2**20
    assert m["expert_cache_slots"] == sum(L.rows.nbytes for L in p.layers.values())
    assert m["scratch"] == sum(r.nbytes for r in p._scratch)
    assert m["host_tier"] == (sum(t.nbytes for t in p.tier.layers.values()) if offload == "host" else 0)
    # CPU: the disk tier's own staging rows (reads land there, then are copied / decoded into a slot)
    assert m["staging"] == (sum(r.nbytes for r in p.tier._stages + p.tier._rows) if offload == "disk" else 0)


@pytest.mark.parametrize("offload", ["host", "disk"])
def test_scratch_rows_are_a_fixed_pool(ckpt, offload):
    """Unions far larger than 2 slots spill through 2 scratch rows allocated with the cache (main allocated a
    new row whenever none was free, unbudgeted and never freed); outputs equal resident ones."""
    prompts = [[i % 90 + 1 for i in range(k, k + 30)] for k in range(5)]
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    ref = LLM(ckpt, dtype="float32")
    llm = LLM(ckpt, dtype="float32", offload=offload, cache_policy="ondemand", cache_experts=2)
    p = llm.store
    rows = [r.data_ptr() for r in p._scratch]
    assert [o.token_ids for o in llm.generate(prompts, sp)] == [o.token_ids for o in ref.generate(prompts, sp)]
    s = llm.stats
    assert s["scratch_fetches"] > 6 * len(llm.config.moe_layers)  # each prefill layer spilled several experts
    assert s["scratch_buffers"] == 2 and sorted(r.data_ptr() for r in p._scratch) == sorted(rows)


RSS_RUN = """
    from specmoe import LLM, SamplingParams
    x = torch.randn(256, 256); (x @ x).sum()  # torch's own first-use allocations, before the baseline
    r0 = rss()
    llm = LLM(dtype="float32", decoding="specmoe", **KW)
    peak = [rss()]
    llm.store.forward_observers.append(lambda *a: peak.append(rss()))  # every MoE layer of target forwards
    prompts = [[(7 * i + j) % 8000 + 1 for j in range(40)] for i in range(4)]
    llm.generate(prompts, SamplingParams(max_tokens=24, ignore_eos=True))
    peak.append(rss())
    s = llm.stats
    out.update(peak=max(peak) - r0, weights=sum(p.numel() * p.element_size() for p in llm.model.parameters()),
               kv=llm._cache.nbytes, scratch_fetches=s.get("scratch_fetches", 0), refreshes=s["draft_set_refreshes"],
               slot=s["compute_bytes_per_expert"])
"""


def test_rss_stays_within_memory_budget(tmp_path):
    """Demo model computed in fp32 (6 MoE layers, 32 experts; an expert slot holds 288 KiB of fp32, or 144 KiB of
    the stored bf16 where the native kernels compute from it), disk tier, SpecMoE with 4 draft experts,
    memory_budget=16 MiB. Anonymous RSS of a fresh process, sampled at every MoE layer of every target
    forward, minus the non-expert weights and the KV cache, minus the overhead a control run measures
    (activations, allocator, tokenizer: the same run with every expert resident, whose expert bytes are
    exact), must stay within the budget + 5 MiB (measured 14-17.4 MiB). Main measured
    ~27 MiB here: its 8 default slots (13.5 MiB) filled the budget, the draft's copy (6.75 MiB) and the
    scratch rows it grew on demand and never freed (24 here) came on top."""
    import torch
    budget, N = 16 * MiB, 4
    repack = str(tmp_path / "repack")
    LLM(dtype="float32", offload="disk", repack_dir=repack, cache_experts=2)  # repack once, outside the runs
    control = run_measured(RSS_RUN.replace("**KW", "offload='none', draft_experts=1"))
    run = run_measured(RSS_RUN.replace("**KW", f"offload='disk', repack_dir={repack!r}, memory_budget={budget}, "
                                               f"draft_experts={N}"))
    assert run["scratch_fetches"] > 0 and run["refreshes"] > 0  # the run spilled and refreshed its draft set
    cfg = Checkpoint(ROOT / "models" / "specmoe-tiny-moe").config
    L, eb = len(cfg.moe_layers), control["slot"]
    assert eb in (cfg.expert_numel * torch.float32.itemsize, cfg.expert_numel * torch.bfloat16.itemsize)
    control_experts = cfg.num_experts * L * eb  # all experts resident (the draft reads them in place)
    overhead = control["peak"] - control["weights"] - control["kv"] - control_experts
    used = run["peak"] - run["weights"] - run["kv"] - overhead
    print(f"expert memory used {used / MiB:.1f} MiB of memory_budget {budget / MiB:.0f} MiB "
          f"(overhead {overhead / MiB:.1f} MiB, weights {run['weights'] / MiB:.1f} MiB, KV {run['kv'] / MiB:.1f} MiB)")
    assert used <= budget + 5 * MiB, (used / MiB, overhead / MiB, run, control)
