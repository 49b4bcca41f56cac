"""Integrity of the disk tier: every expert read is checked against its checksum from the repack
manifest (not only the 8 sampled at open), short reads are errors, and old or touched repacks are
handled (rebuilt, kept) instead of crashing or being called stale."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from specmoe import LLM
from specmoe.errors import CheckpointError, IntegrityError
from specmoe.experts import integrity
from specmoe.experts.repack import sample_ids
from tests.conftest import make_tiny_checkpoint

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11]]


def requested_unsampled(path) -> tuple[int, int]:
    """A (layer, expert) that greedy generation of PROMPTS requests and that the open-time sample skips."""
    llm = LLM(path)
    llm.generate(PROMPTS)
    counts = llm.stats["expert_counts"]
    sampled = set(sample_ids(llm.config.moe_layers, llm.config.num_experts))
    for li, layer in enumerate(llm.config.moe_layers):
        for e, c in enumerate(counts[li]):
            if c and (layer, e) not in sampled:
                return layer, e
    raise AssertionError("every requested expert is sampled")


def flip(rp, layer: int, e: int, at: int = 123) -> None:
    """Flip one bit of expert (layer, e) in the repack file, in place (same size, same inode)."""
    off = rp.offset(layer, e) + at
    with open(rp.file, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x10]))


def files_under(d) -> dict:
    return {p: p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture
def ckpt(tmp_path):
    return make_tiny_checkpoint("mixtral", tmp_path / "ck")


def test_corrupt_unsampled_expert_is_caught_at_its_read(ckpt):
    layer, e = requested_unsampled(ckpt)
    with LLM(ckpt, offload="disk", cache_experts=2) as llm:
        rp = llm.store.tier.rp
    flip(rp, layer, e)
    outside = {p: b for p, b in files_under(ckpt.parent).items() if ".specmoe" not in p.parts}
    repack_files = files_under(rp.file.parent)
    llm = LLM(ckpt, offload="disk", cache_experts=2)  # the open-time sample does not see it
    with pytest.raises(IntegrityError) as ei:
        llm.generate(PROMPTS)
    msg = str(ei.value)
    assert f"layer {layer} expert {e} " in msg and str(rp.file) in msg
    assert f"delete {rp.file} and {rp.manifest}" in msg and "\n" not in msg
    llm.close()
    assert {p: b for p, b in files_under(ckpt.parent).items() if ".specmoe" not in p.parts} == outside
    assert files_under(rp.file.parent) == repack_files  # reported, not silently "repaired"


def test_corruption_during_a_run_is_caught_at_the_read(ckpt):
    layer, e = requested_unsampled(ckpt)
    ref = LLM(ckpt).generate(PROMPTS)
    llm = LLM(ckpt, offload="disk", cache_policy="ondemand", cache_experts=4)
    assert [o.token_ids for o in llm.generate(PROMPTS)] == [o.token_ids for o in ref]
    reads = llm.stats["io_reads"]
    assert reads == llm.stats["misses"] > 0 and llm.stats["io_verify_s"] > 0  # every read was verified
    flip(llm.store.tier.rp, layer, e, at=llm.store.tier.rp.expert_bytes - 1)
    with pytest.raises(IntegrityError, match=f"layer {layer} expert {e} .*fails its checksum"):
        llm.generate(PROMPTS)
    llm.close()


def test_short_read_is_an_error_not_an_assert(ckpt):
    llm = LLM(ckpt, offload="disk", cache_policy="ondemand", cache_experts=4)
    llm.generate(PROMPTS)
    rp = llm.store.tier.rp
    last = llm.config.moe_layers[-1]
    os.truncate(rp.file, rp.offset(last, 0) + rp.stride // 2)  # the last MoE layer's experts are cut
    with pytest.raises(IntegrityError, match=f"short read of layer {last} expert .* bytes"):
        llm.generate(PROMPTS)
    llm.close()
    with pytest.warns(UserWarning, match="rebuilding .*missing or truncated"):  # the next open repacks
        llm = LLM(ckpt, offload="disk", cache_policy="ondemand", cache_experts=4)
    llm.generate(PROMPTS)
    llm.close()


def test_checksum_catches_flips_swaps_and_zeroed_blocks():
    rng = np.random.default_rng(0)
    buf = rng.integers(0, 256, 4 * 4096, dtype=np.uint8)
    ref = integrity.checksum(buf)
    for i in rng.integers(0, buf.size, 64):  # any single bit
        b = buf.copy()
        b[i] ^= 1 << int(rng.integers(8))
        assert integrity.checksum(b) != ref
    w = buf.copy().view(np.uint64)  # bit 63 set in one word and cleared in another of the same column
    w[0] |= np.uint64(1 << 63)
    w[512] &= ~np.uint64(1 << 63)
    base = integrity.checksum(w.view(np.uint8))
    w[0] &= ~np.uint64(1 << 63)
    w[512] |= np.uint64(1 << 63)
    assert integrity.checksum(w.view(np.uint8)) != base
    b = buf.copy()
    b[:4096], b[4096:8192] = buf[4096:8192], buf[:4096]  # two 4 KiB blocks swapped
    assert integrity.checksum(b) != ref
    b = buf.copy()
    b[8192:12288] = 0
    assert integrity.checksum(b) != ref
    assert integrity.checksum(torch.from_numpy(buf)) == ref


def test_old_format_repack_is_rebuilt_not_a_crash(ckpt, tmp_path):
    rp_dir = ckpt / ".specmoe"
    rp_dir.mkdir()
    # what specmoe wrote before per-read checksums: unkeyed names, format 1, sampled crc32 only
    v1 = {"format": 1, "model_type": "mixtral", "dtype": "float32", "file": "experts-float32.bin",
          "source": str(ckpt.resolve()), "fingerprint": "model.safetensors:1:2", "crc32": {"0:0": 1}}
    (rp_dir / "experts-float32.json").write_text(json.dumps(v1))
    (rp_dir / "experts-float32.bin").write_bytes(b"\0" * 4096)
    other = tmp_path / "other-model"
    other_v1 = {**v1, "source": str(other)}  # another checkpoint's old repack in a shared dir
    (rp_dir / "experts-bfloat16.json").write_text(json.dumps(other_v1))
    with pytest.warns(UserWarning, match="old-format expert repack"):
        llm = LLM(ckpt, offload="disk", cache_experts=2)
    assert not (rp_dir / "experts-float32.json").exists() and not (rp_dir / "experts-float32.bin").exists()
    assert json.loads((rp_dir / "experts-bfloat16.json").read_text()) == other_v1  # not ours: untouched
    man = llm.store.tier.rp.manifest
    llm.close()
    # a manifest of the current name but an old or malformed shape is rebuilt too
    for bad in ({**v1, "format": 1}, [1, 2, 3], None):
        man.write_text(json.dumps(bad))
        with pytest.warns(UserWarning, match="rebuilding"):
            with LLM(ckpt, offload="disk", cache_experts=2) as llm:
                assert llm.logits(PROMPTS).shape[0] == 2
        assert json.loads(man.read_text())["format"] == 2
    man.write_bytes(b"\xff\xfe not json")
    with pytest.warns(UserWarning, match="unreadable"):
        LLM(ckpt, offload="disk", cache_experts=2).close()
    good = json.loads(man.read_text())
    man.write_text(json.dumps({**good, "file": "experts-bfloat16.bin"}))  # pointing at another file: rebuilt
    with pytest.warns(UserWarning, match="malformed"):
        LLM(ckpt, offload="disk", cache_experts=2).close()
    assert json.loads(man.read_text()) == good
    # an older specmoe run again leaves its files: the next open (of a valid repack) removes ours only
    (rp_dir / "experts-float32.json").write_text(json.dumps(v1))
    (rp_dir / "experts-float32.bin").write_bytes(b"\0" * 4096)
    with pytest.warns(UserWarning, match="old-format expert repack"):
        LLM(ckpt, offload="disk", cache_experts=2).close()
    assert not (rp_dir / "experts-float32.json").exists() and (rp_dir / "experts-bfloat16.json").exists()


def test_touched_checkpoint_keeps_its_repack(ckpt):
    """A new mtime with the same bytes (touch, a copy that drops times) is not a changed checkpoint."""
    with LLM(ckpt, offload="disk", cache_experts=2) as llm:
        rp = llm.store.tier.rp
        ref = llm.logits(PROMPTS)
    st_bin = os.stat(rp.file)
    w = ckpt / "model.safetensors"
    os.utime(w, ns=(os.stat(w).st_atime_ns, os.stat(w).st_mtime_ns + 10**9))
    with LLM(ckpt, offload="disk", cache_experts=2) as llm:
        assert torch.equal(llm.logits(PROMPTS), ref)
    st = os.stat(rp.file)
    assert (st.st_ino, st.st_mtime_ns) == (st_bin.st_ino, st_bin.st_mtime_ns)  # not repacked
    assert json.loads(rp.manifest.read_text())["checkpoint_files"]["model.safetensors"]["mtime_ns"] == \
        os.stat(w).st_mtime_ns  # remembered: the next open does not hash again


def test_changed_checkpoint_message_names_only_its_own_files(ckpt, tmp_path):
    """Two checkpoints share one repack dir: each has its own files, and the stale-repack message
    advises deleting this checkpoint's files, never the shared directory."""
    shared = tmp_path / "shared"
    other = make_tiny_checkpoint("mixtral", tmp_path / "ck2", seed=1)
    with LLM(ckpt, offload="disk", repack_dir=shared) as a, LLM(other, offload="disk", repack_dir=shared) as b:
        fa, fb = a.store.tier.rp, b.store.tier.rp
        assert fa.file != fb.file and fa.manifest != fb.manifest
        assert not torch.equal(a.logits(PROMPTS), b.logits(PROMPTS))
    before = files_under(shared)
    w = other / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-5] ^= 1  # a weight byte of the other model changes (same size)
    w.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="changed after its experts were repacked") as ei:
        LLM(other, offload="disk", repack_dir=shared)
    msg = str(ei.value)
    assert f"delete {fb.file} and {fb.manifest}" in msg and f"delete {shared} " not in msg
    assert str(fa.file) not in msg
    assert files_under(shared) == before  # nothing rewritten
    LLM(ckpt, offload="disk", repack_dir=shared).close()  # the first model's repack is still valid


@pytest.mark.filterwarnings("ignore:.*no expert_profile.json")
def test_shared_repack_dir_keeps_one_profile_per_checkpoint(ckpt, tmp_path):
    """The static policy's auto profile is cached next to the repack, keyed by checkpoint too: two
    checkpoints sharing a repack_dir do not overwrite each other's profile."""
    import warnings
    shared = tmp_path / "shared"
    other = make_tiny_checkpoint("mixtral", tmp_path / "ck2", seed=1)
    for p in (ckpt, other):
        LLM(p, offload="disk", repack_dir=shared, cache_policy="static", cache_experts=4).close()
    assert len(list(shared.glob("expert_profile-*.json"))) == 2
    for p in (ckpt, other):  # each reuses its own profile: no profiling run, no warning
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            LLM(p, offload="disk", repack_dir=shared, cache_policy="static", cache_experts=4).close()


def test_cli_reports_a_corrupt_expert_in_one_line(tmp_path):
    """The demo model through `specmoe generate`: a flipped byte in every expert the open-time sample
    skips is one line on stderr naming layer, expert and file, and exit 2."""
    import re
    import shutil
    import subprocess
    import sys
    from pathlib import Path

    from specmoe.engine.llm import DEMO_MODEL
    ck = tmp_path / "demo"
    shutil.copytree(DEMO_MODEL, ck, ignore=shutil.ignore_patterns(".specmoe"))
    with LLM(ck, offload="disk") as llm:
        rp, cfg = llm.store.tier.rp, llm.config
    sampled = set(sample_ids(cfg.moe_layers, cfg.num_experts))
    for layer in cfg.moe_layers:
        for e in range(cfg.num_experts):
            if (layer, e) not in sampled:
                flip(rp, layer, e, at=999)
    r = subprocess.run([sys.executable, "-m", "specmoe", "generate", "--model", str(ck), "--offload", "disk",
                        "--prompt", "def parse(", "--max-tokens", "4"],
                       capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2])
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = [x for x in r.stderr.splitlines() if x.startswith("specmoe: error:")]
    want = rf"expert repack file {rp.file} is corrupt: layer \d+ expert \d+ .*fails its checksum; delete {rp.file}"
    assert len(lines) == 1 and re.search(want, lines[0]), r.stderr


SHORT_READ_UNDER_O = """
import os, sys
assert False, "this script must run under python -O"
from specmoe import LLM
from specmoe.errors import IntegrityError
llm = LLM(sys.argv[1], offload="disk", cache_policy="ondemand", cache_experts=4)
llm.generate([[1, 2, 3]])
rp = llm.store.tier.rp
os.truncate(rp.file, rp.offset(llm.config.moe_layers[-1], 0) + 100)
try:
    llm.generate([[1, 2, 3]])
except IntegrityError as e:
    print("IntegrityError:", e)
"""


def test_short_read_is_an_error_under_python_O(ckpt):
    """Asserts vanish under -O: the short-read check must not be one."""
    import subprocess
    import sys
    from pathlib import Path
    r = subprocess.run([sys.executable, "-O", "-c", SHORT_READ_UNDER_O, str(ckpt)], capture_output=True, text=True,
                       timeout=300, cwd=Path(__file__).parents[2])
    assert r.returncode == 0, r.stderr
    assert "IntegrityError: short read of layer" in r.stdout, r.stdout + r.stderr


def test_a_failed_prefetch_leaves_no_corrupt_expert_resident(ckpt):
    """A corrupt expert loaded by prefetch raises at its layer and is dropped from its slot: a caller that
    catches the error (a server) and repairs the file gets exact outputs again, never the bad bytes."""
    ref = LLM(ckpt).generate(PROMPTS)
    llm = LLM(ckpt, offload="disk", cache_policy="ondemand", cache_experts=8, prefetch="oracle")
    assert [o.token_ids for o in llm.generate(PROMPTS)] == [o.token_ids for o in ref]  # recorded
    layer, ids = next((layer, ids) for layer, ids in llm.store.oracle.trace if layer != llm.config.moe_layers[0])
    rp = llm.store.tier.rp
    flip(rp, layer, ids[0])  # an expert the replay prefetches for `layer`
    llm.store.start_oracle_replay()
    with pytest.raises(IntegrityError, match=f"layer {layer} expert {ids[0]} "):
        llm.generate(PROMPTS)
    assert ids[0] not in llm.store.resident(layer)
    flip(rp, layer, ids[0])  # repaired
    llm.store.start_oracle_replay()
    assert [o.token_ids for o in llm.generate(PROMPTS)] == [o.token_ids for o in ref]
    assert llm.stats["prefetch_useful"] > 0
    llm.close()
