"""benchmarks/over_ram.py and its parts: sparse weight files, page-cache residency and dropping, the balloon and its
guard, the per-token timeline, the disk check, the chunked affinity table, and the whole pipeline on a tiny widened
copy (`--dry-run`; llama.cpp rows skipped, with the reason, where llama_cpp is not importable)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from specmoe.bench import overram_runs, sysprobe
from specmoe.bench.widen import SPARSE_CHUNK, save_sparse
from specmoe.errors import InputError

REPO = Path(__file__).resolve().parents[2]


def test_save_sparse_reads_back_exactly_and_leaves_holes(tmp_path):
    big = torch.zeros(64, SPARSE_CHUNK, dtype=torch.bfloat16)  # 8 MiB, two non-zero spots
    big[0, :5] = torch.tensor([1.5, -2, 3, 0.25, 7])
    big[-1, -1] = 9
    odd = torch.arange(7, dtype=torch.float32)  # a tail shorter than a chunk
    f = tmp_path / "m.safetensors"
    info = save_sparse({"b": big, "a": odd, "z": torch.zeros(3, dtype=torch.int64)}, f, metadata={"format": "pt"})
    with safe_open(str(f), framework="pt") as h:
        assert h.metadata() == {"format": "pt"}
        assert torch.equal(h.get_tensor("b"), big) and torch.equal(h.get_tensor("a"), odd)
        assert torch.equal(h.get_tensor("z"), torch.zeros(3, dtype=torch.int64))
    a = sysprobe.allocation(f)
    assert a["apparent_bytes"] == info["apparent_bytes"] > 8 << 20
    assert info["written_bytes"] < 4 * SPARSE_CHUNK
    assert a["allocated_bytes"] < a["apparent_bytes"] // 4, a  # the zero runs are holes
    with pytest.raises(InputError, match="sparse"):
        overram_runs._fully_allocated(f, "the test file")


def test_residency_drop_and_allocation(tmp_path):
    f = tmp_path / "data.bin"
    f.write_bytes(os.urandom(1 << 20))
    f.read_bytes()
    assert sysprobe.residency(f)["resident_bytes"] > 0
    after = sysprobe.drop_cache(f)
    assert after == {"resident_bytes": 0, "file_bytes": 1 << 20}
    assert overram_runs._fully_allocated(f, "x")["allocated_bytes"] >= 1 << 20


def test_balloon_holds_memory_is_labelled_and_dies_with_its_owner():
    with sysprobe.Balloon(0.1, floor_gib=0.5) as b:
        assert b.alive and b.info["rss_anon_bytes"] >= 0.09 * sysprobe.GiB
        assert b.info["label"] == "emulated smaller RAM (balloon 0.1 GiB)"
        pid = b.info["pid"]
    assert not b.alive and not Path(f"/proc/{pid}").exists()
    avail = sysprobe.meminfo()["MemAvailable"] / sysprobe.GiB
    with pytest.raises(InputError, match=r"balloon of .* refused: MemAvailable is .* below the floor"):
        with sysprobe.Balloon(avail, floor_gib=3.0):
            pass
    assert sysprobe.label(0) == "full RAM (no balloon)"


def test_timeline_windows():
    tl = sysprobe.Timeline()
    # (t, tokens, read bytes, anon, file): prefill at 1 s; token 4 at 3 s; a speculative step jumps 4 -> 7
    tl.records = [(1.0, 1, 100, 10, 1), (2.0, 2, 150, 10, 1), (3.0, 4, 200, 10, 1), (4.0, 7, 500, 20, 2),
                  (5.0, 10, 800, 30, 3)]
    s = tl.summary(window=4)
    assert s["prefill_s"] == 1.0 and s["first_tokens"] == 4 and s["first_tok_s"] == pytest.approx(4 / 3)
    assert s["steady_tokens"] == 6 and s["steady_tok_s"] == pytest.approx(6 / 2)
    assert s["steady_read_bytes_per_token"] == pytest.approx(600 / 6) and s["read_bytes_per_token"] == 80
    assert s["steady_footprint_bytes"] == 22  # median of 11, 22, 33


def test_check_disk_refuses_with_the_numbers(tmp_path):
    assert overram_runs.check_disk(tmp_path, {"repack": 1})["need_bytes"] > 1
    with pytest.raises(InputError, match=r"need .* GB \(repack .* GB, gguf .*\), free .* GB"):
        overram_runs.check_disk(tmp_path, {"repack": 1 << 50, "gguf": 1 << 40})


def test_plan_and_system_names():
    from specmoe.engine.llm import DEMO_MODEL
    p = overram_runs.plan_bytes(DEMO_MODEL, overram_runs.BIG)
    assert p["hidden"] == 4096 and p["expert_intermediate"] == 6144 and p["expert_bytes"] == 144 << 20
    assert p["expert_total_bytes"] / p["model_bytes"] > 0.99
    assert overram_runs.system_options("eagle-g4") == {"decoding": "specmoe", "drafter": "eagle", "num_draft_tokens": 4,
                                                  "draft_tree": False, "cache_policy": "lru"}
    with pytest.raises(InputError, match="expected"):
        overram_runs.system_options("eagle4")


def test_affinity_in_chunks_equals_the_whole_gram(tiny_ckpt, monkeypatch):
    from specmoe.decoding.drafters import affinity
    from specmoe.weights.checkpoint import Checkpoint
    from specmoe.weights.names import expert_parts
    ck = Checkpoint(tiny_ckpt("qwen3_moe"))
    monkeypatch.setattr(affinity, "CHUNK", 100)  # parts of 24·32 values: 8 chunks each, the last one short
    got = affinity.compute_affinity(ck)
    cfg = ck.config
    for layer in cfg.moe_layers:
        w = torch.stack([torch.cat([ck.read_part(expert_parts(cfg, layer, e)[p], torch.float64).reshape(-1)
                                    for p in ("gate", "up", "down")]) for e in range(cfg.num_experts)])
        torch.testing.assert_close(got[layer], torch.cdist(w, w).float(), rtol=1e-5, atol=1e-5)


def test_dry_run_pipeline(tmp_path):
    """The whole benchmark on a tiny widened copy, both workloads under a 2x limit (a cgroup where this machine
    has the controller as root, else the labelled balloon): artifacts, fresh processes, caches dropped, every figure
    recorded; the forced runs emit the documents' tokens; llama.cpp rows skipped with the reason where llama_cpp is
    not importable or its converter is not in the (empty) cache dir."""
    from specmoe.bench import cgroup
    out = tmp_path / "res.json"
    env = {k: v for k, v in os.environ.items() if k != "SPECMOE_LLAMA_SITE"}
    proc = subprocess.Popen([sys.executable, str(REPO / "benchmarks" / "over_ram.py"), "--dry-run", "--cache-dir",
                           str(tmp_path / "cache"), "--out", str(out), "--systems", "llama.cpp,lru,auto",
                           "--max-tokens", "12", "--window", "4", "--limits", "2x", "--documents", "4",
                           "--workload", "natural-forced,sampled", "--no-costs"],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    stdout, stderr = proc.communicate(timeout=900)
    assert proc.returncode == 0, stdout[-2000:] + stderr[-3000:]
    res = json.loads(out.read_text())
    assert out.with_suffix(".png").is_file()
    assert res["dry_run"] and res["commit"] and res["flags"]["max_tokens"] == 12 and res["flags"]["repeats"] == 1
    art = res["artifacts"]
    assert art["greedy_check"]["identical_sequences"] == 1
    assert art["repack"]["allocated_bytes"] >= art["repack"]["apparent_bytes"]
    assert art["safetensors"][0]["allocated_bytes"] < art["safetensors"][0]["apparent_bytes"]  # written sparse
    docs = res["documents"]
    assert len(docs) == 4 and {d["domain"] for d in docs} == {"code", "bible", "docs", "fortunes"}
    kind = "cgroup" if cgroup.unavailable() is None else "balloon"
    assert [(b["workload"], b["limit"]) for b in res["blocks"]] == [("natural-forced", kind), ("sampled", kind)]
    if kind == "cgroup":  # every cgroup this run made is removed (another benchmark's may exist meanwhile)
        assert not list(cgroup.ROOT.glob(f"specmoe-overram-{proc.pid}-*"))
    for block in res["blocks"]:
        assert block["prompts"] == 4 and block["max_tokens"] == 12 and block["model_over_ram"] > 0
        runs = {r["system"]: r for r in block["runs"]}
        llama = runs["llama.cpp"]
        assert (res["llama_cpp"]["version"] is None) == bool(res["llama_cpp"]["skipped_reason"])  # recorded when run
        if res["llama_cpp"]["skipped_reason"]:
            assert llama["status"] == "skipped" and llama["reason"] == res["llama_cpp"]["skipped_reason"]
        for name in ("lru@limit", "auto@limit"):
            r = runs[name]
            assert r["status"] == "ok", r
            assert r["workload"] == block["workload"] and r["tokens"] == 4 * 12
            assert r["steady_tok_s"] > 0 and r["first_tok_s"] > 0
            assert 0 < r["hit_rate"] < 1 and r["read_bytes"] > 0  # the cache missed and the misses came from storage
            assert r["residency_before"]["repack"]["resident_bytes"] == 0  # dropped before the run
            assert r["residency_after"]["repack"]["resident_bytes"] == 0  # direct reads only
            assert r["peak_rss_anon_bytes"] > 0 and r["samples"]
            how = r["budget_how"]
            assert r["memory_budget_bytes"] == how["limit_bytes"] - how["non_expert_compute_bytes"] - how["headroom_bytes"]
            assert r["expert_memory_bytes"] <= r["memory_budget_bytes"]
            wins = r["routing_windows"]["per_document"]
            assert len(wins) == 4 and all(w["windows"][0]["distinct_per_layer"] for w in wins)  # routing observed
            if kind == "cgroup":
                cg = r["cgroup"]
                assert cg["limit_bytes"] == block["limit_plan"]["limit_bytes"] // 4096 * 4096
                assert 0 < cg["max_usage_bytes"] <= cg["limit_bytes"] and "total_cache" in cg["memory_stat"]
            if block["workload"] == "natural-forced":
                assert r["token_ids"] == [d["forced"][:12] for d in docs]  # the documents, token for token
        assert runs["auto@limit"]["token_ids"] == runs["lru@limit"]["token_ids"]  # forced, and seeded alike
        assert block["summary"]["lru@limit"]["repeats_ok"] == 1
        assert any(t["target"].endswith("(repeats that differ)") and t["value"] == 0 for t in block["targets"])
