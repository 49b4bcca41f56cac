"""Disk tier (O_DIRECT, repack manifest) and clear errors on bad input."""
from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from specmoe import LLM
from specmoe.experts.buffers import alloc_rows
from specmoe.errors import CheckpointError, InputError, MemoryBudgetError
from tests.conftest import make_tiny_checkpoint

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]


def test_disk_tier_uses_o_direct_and_aligned_repack(tiny_ckpt):
    path = tiny_ckpt("mixtral")
    llm = LLM(path, offload="disk", cache_experts=2)
    tier = llm.store.tier
    assert tier.direct_io and llm.stats["direct_io"] is True
    assert fcntl.fcntl(tier.fd, fcntl.F_GETFL) & os.O_DIRECT
    rp = tier.rp
    assert rp.file.parent == path / ".specmoe" and rp.stride % 4096 == 0
    assert rp.file.stat().st_size == rp.stride * len(llm.config.moe_layers) * llm.config.num_experts
    man = json.loads(rp.manifest.read_text())
    assert man["checkpoint_files"] == llm.ckpt.content_fingerprint() and len(man["sums"]) == 3 * 8
    # one aligned read per expert gives exactly the checkpoint's packed expert
    buf = alloc_rows(1, llm.store.slot_bytes, torch.device("cpu"))[0]
    tier.read_into(2, 5, buf)
    assert torch.equal(buf[: rp.expert_bytes].view(torch.float32), llm.ckpt.read_expert(2, 5, torch.float32))


def test_repack_dir_option_and_reuse(tiny_ckpt, tmp_path):
    path = tiny_ckpt("olmoe")
    f = LLM(path, offload="disk", repack_dir=tmp_path / "rp").store.tier.rp.file
    assert f.parent == tmp_path / "rp" and f.name.startswith("experts-float32-")
    mtime = f.stat().st_mtime_ns
    LLM(path, offload="disk", repack_dir=tmp_path / "rp")  # validated and reused, not rewritten
    assert f.stat().st_mtime_ns == mtime


def test_unwritable_repack_dir_names_it(tiny_ckpt, tmp_path):
    (tmp_path / "file.txt").write_text("a regular file")  # a path under a file fails even for root
    bad = tmp_path / "file.txt" / "sub"
    with pytest.raises(InputError, match="file.txt/sub"):
        LLM(tiny_ckpt("mixtral"), offload="disk", repack_dir=bad)


@pytest.mark.parametrize("keep_mtime", [False, True])
def test_checkpoint_modified_after_repack(tmp_path, keep_mtime):
    path = make_tiny_checkpoint("mixtral", tmp_path / "ck")
    LLM(path, offload="disk")
    rp = path / ".specmoe"
    before = {p.name: p.read_bytes() for p in rp.iterdir()}
    st = path / "model.safetensors"
    old = os.stat(st)
    tensors = load_file(st)
    key = "model.layers.0.block_sparse_moe.experts.0.w1.weight"
    tensors[key] = tensors[key] + 1.0  # same size, new content
    save_file(tensors, st, metadata={"format": "pt"})
    if keep_mtime:  # fingerprint (sizes + mtimes) unchanged: the sampled checksums must catch it
        os.utime(st, ns=(old.st_atime_ns, old.st_mtime_ns))
        assert os.stat(st).st_size == old.st_size
    with pytest.raises(CheckpointError, match="changed after its experts were repacked"):
        LLM(path, offload="disk")
    assert {p.name: p.read_bytes() for p in rp.iterdir()} == before  # nothing rewritten or corrupted


def test_cache_smaller_than_top_k(tiny_ckpt):
    with pytest.raises(InputError, match="top-k"):
        LLM(tiny_ckpt("mixtral"), offload="host", cache_experts=1)
    with pytest.raises(InputError, match="top-k"):
        LLM(tiny_ckpt("mixtral"), offload="disk", cache_bytes=4096)


def test_budget_larger_than_machine(tiny_ckpt):
    with pytest.raises(MemoryBudgetError, match="larger than"):
        LLM(tiny_ckpt("mixtral"), offload="host", memory_budget="100TiB")
    with pytest.raises(MemoryBudgetError, match="larger than"):
        LLM(tiny_ckpt("mixtral"), offload="disk", cache_bytes=2**50)


def test_budget_too_small_for_host_tier(tiny_ckpt):
    with pytest.raises(MemoryBudgetError, match="memory_budget"):
        LLM(tiny_ckpt("mixtral"), offload="host", cache_experts=2, memory_budget=200_000)


def test_bad_options():
    from specmoe.options import OffloadConfig
    with pytest.raises(InputError, match="need offload='host'"):
        OffloadConfig(offload="disk", link_gbps=1.0)
    with pytest.raises(InputError, match="byte size"):
        OffloadConfig(cache_bytes="lots")
    with pytest.raises(InputError, match="cache_policy"):
        OffloadConfig(cache_policy="fifo")
    assert OffloadConfig(memory_budget="1.5GiB").memory_budget == int(1.5 * 2**30)


def test_cli_flags_and_profile_command(tiny_ckpt, tmp_path):
    from specmoe.cli import build_parser
    from specmoe.cli.common import option_kwargs
    args = build_parser().parse_args(["generate", "--offload", "disk", "--cache-bytes", "2MiB", "--cache-experts",
                                      "3", "--link-gbps", "1.5", "--prefetch", "predicted"])
    kw = option_kwargs(args)
    assert kw["cache_bytes"] == 2 * 2**20 and kw["cache_experts"] == 3 and kw["link_gbps"] == 1.5
    out = tmp_path / "prof"
    r = subprocess.run([sys.executable, "-m", "specmoe", "profile", "--model", str(tiny_ckpt("qwen2_moe")),
                        "--out-dir", str(out), "--max-tokens", "2", "--offload", "host", "--json"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "tokenizer" in r.stderr  # tiny checkpoints carry no tokenizer


def test_profile_helpers(tiny_ckpt, tmp_path):
    from specmoe.experts import profiling
    llm = LLM(tiny_ckpt("qwen2_moe"))
    llm.logits([[1, 2, 3, 4]] * 4)
    counts = llm.stats["expert_counts"]
    prof = profiling.profile_dict(counts, llm.config)
    assert len(prof["skewness"]) == len(llm.config.moe_layers) and all(0.25 <= x <= 1 for x in prof["skewness"])
    profiling.save_profile(tmp_path / "expert_profile.json", prof)
    assert profiling.load_profile(tmp_path / "expert_profile.json", llm.config) == counts
    (tmp_path / "bare.json").write_text(json.dumps(counts))
    assert profiling.load_profile(tmp_path / "bare.json", llm.config) == counts
    assert profiling.heatmap(counts, llm.config, tmp_path / "h.png").stat().st_size > 0
    hot = profiling.hot_experts(counts, llm.config)
    assert all(len(v) == 1 for v in hot.values())  # ceil(10% of 8)


def test_repack_falls_back_to_user_cache_dir(tmp_path, monkeypatch):
    path = make_tiny_checkpoint("qwen3_moe", tmp_path / "ck")
    (path / ".specmoe").write_text("not a directory")  # <checkpoint>/.specmoe unusable, even for root
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    with pytest.warns(UserWarning, match="repacking into .*home/.cache/specmoe"):
        llm = LLM(path, offload="disk", cache_experts=2)
    assert llm.store.tier.rp.file.is_relative_to(tmp_path / "home" / ".cache" / "specmoe")
    assert torch.equal(llm.logits(PROMPTS), LLM(path).logits(PROMPTS))


def test_filesystem_without_o_direct_falls_back_with_warning(tiny_ckpt, monkeypatch):
    import errno

    from specmoe.experts import tiers
    real_open = os.open

    def refuse_direct(path, flags, *a):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *a)
    monkeypatch.setattr(tiers.os, "open", refuse_direct)
    path = tiny_ckpt("mixtral")
    with pytest.warns(UserWarning, match="refuses O_DIRECT"):
        llm = LLM(path, offload="disk", cache_experts=2)
    monkeypatch.undo()
    assert llm.stats["direct_io"] is False
    assert not fcntl.fcntl(llm.store.tier.fd, fcntl.F_GETFL) & os.O_DIRECT
    assert torch.equal(llm.logits(PROMPTS), LLM(path).logits(PROMPTS))


@pytest.mark.parametrize("io_depth", [1, 3])
def test_disk_reads_in_flight_at_once(tiny_ckpt, monkeypatch, io_depth):
    """io_depth=n: the disk tier serves n reads at once (one I/O thread each; slowed reads here, so they
    overlap), and the output stays bit-identical to resident experts."""
    path = tiny_ckpt("qwen3_moe")
    ref = LLM(path).logits(PROMPTS)
    import specmoe.experts.tiers as tiers
    real = os.preadv

    def slow(*a):
        import time
        time.sleep(0.01)
        return real(*a)
    monkeypatch.setattr(tiers.os, "preadv", slow)
    llm = LLM(path, offload="disk", cache_experts=3, cache_policy="lru", io_depth=io_depth)
    assert torch.equal(llm.logits(PROMPTS), ref)
    s = llm.stats
    assert s["io_depth"] == io_depth and s["misses"] > io_depth and s["io_reads"] >= s["misses"]
    assert s["io_max_inflight"] == io_depth, s["io_max_inflight"]
    assert llm.store.tier.staging_bytes == io_depth * (1 + tiers.DiskTier.STAGE_ROWS) * (
        -(-s["bytes_per_expert"] // 4096) * 4096)


def test_io_depth_is_checked():
    with pytest.raises(InputError, match="io_depth"):
        LLM(None, offload="disk", io_depth=0)


@pytest.mark.parametrize("bad", [1.5, "7", None, -1, True, [2], float("nan")])
def test_static_policy_profile_with_a_non_integer_count_is_one_clear_error(tmp_path, bad):
    path = make_tiny_checkpoint("qwen3_moe", tmp_path / "ck")
    cfg = LLM(path).config
    rows = [[3] * cfg.num_experts for _ in cfg.moe_layers]
    rows[1][2] = bad
    (path / "expert_profile.json").write_text(json.dumps({"counts": rows}))
    with pytest.raises(CheckpointError, match=r"expert_profile.json: counts\[1\]\[2\] is .*integer >= 0"):
        LLM(path, offload="host", cache_experts=2, cache_policy="static")
    if bad == 1.5:  # the CLI: one line, exit status 2, no traceback
        r = subprocess.run([sys.executable, "-m", "specmoe", "generate", "--model", str(path), "--offload", "host",
                            "--cache-experts", "2", "--cache-policy", "static", "--prompt", "x"],
                           capture_output=True, text=True, timeout=300)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert r.stderr.strip().splitlines()[-1].startswith("specmoe: error: expert profile ")  # after progress bars
        assert "counts[1][2] is 1.5" in r.stderr
    rows[1][2] = 4.0  # an integral float, as a writer may print a count
    (path / "expert_profile.json").write_text(json.dumps({"counts": rows}))
    assert LLM(path, offload="host", cache_experts=2, cache_policy="static").store is not None
