"""Engine lifetime: close() / `with LLM(...)` release the disk tier's file, the I/O thread and the
buffers at once (not when the garbage collector gets to them), and a closed engine says so."""
from __future__ import annotations

import errno
import gc
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

import pytest
import torch

from specmoe import LLM, SamplingParams
from specmoe.errors import InputError
from specmoe.experts import repack
from specmoe.weights.checkpoint import Checkpoint
from tests.conftest import make_tiny_checkpoint

ONE = SamplingParams(max_tokens=1)


def open_fds() -> set[tuple[str, str]]:
    """(fd, what it points to) of this process (the fd of the listing itself is gone by the readlink)."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
        except FileNotFoundError:
            pass
    return out


def threads() -> set[threading.Thread]:
    """Live threads, less tqdm's monitor (one per process at most, restarted by any tqdm(), even a disabled
    one; it ends by itself 10 s after the last bar closes)."""
    return {t for t in threading.enumerate() if t.name != "tqdm_monitor"}


def test_close_releases_file_thread_and_buffers_at_once(tmp_path):
    path = make_tiny_checkpoint("mixtral", tmp_path / "ck")  # its own repack file: no other engine has it open
    before = threads()  # engines of other tests may hold I/O threads of their own
    llm = LLM(path, offload="disk", cache_experts=2)
    llm.generate([[1, 2, 3]], ONE)
    tier, cache = llm.store.tier, llm.store
    fd = (str(tier.fd), str(tier.rp.file))
    assert fd in open_fds() and threads() - before  # its I/O thread
    rows = [weakref.ref(L.rows) for L in cache.layers.values()]
    llm.close()  # llm and its store are still referenced: nothing here is the garbage collector's doing
    assert fd not in open_fds() and not any(t == fd[1] for _, t in open_fds())
    assert tier.fd == -1 and not threads() - before
    assert all(r() is None for r in rows)  # the slots are freed
    llm.close()  # idempotent
    for use in (lambda: llm.generate([[1, 2, 3]], ONE), lambda: llm.logits([[1, 2]]), lambda: llm.stats,
                lambda: cache.fetch(1, [0]).__next__()):
        with pytest.raises(InputError, match="closed"):
            use()


def test_with_statement_closes_host_tier(tiny_ckpt):
    before = threads()
    with LLM(tiny_ckpt("qwen3_moe"), offload="host", cache_experts=2) as llm:
        out = llm.generate([[4, 5, 6]], ONE)
        tier = llm.store.tier
        host = [weakref.ref(t) for t in tier.layers.values()]
    assert len(out[0].token_ids) == 1
    assert not threads() - before and all(r() is None for r in host)  # host copies (pinned on CUDA) dropped
    with pytest.raises(InputError, match="closed"):
        llm.generate([[4, 5, 6]], ONE)


def test_fifty_engines_leave_no_fd_or_thread(tiny_ckpt):
    path = tiny_ckpt("olmoe")
    LLM(path, offload="disk", cache_experts=2).close()  # repack and first-use imports happen once, before
    gc.collect()
    fds, ts = open_fds(), threads()  # compared as sets: other tests' engines may be collected meanwhile
    kept = []
    for _ in range(50):
        llm = LLM(path, offload="disk", cache_experts=2)
        llm.generate([[1, 2, 3]], ONE)
        llm.close()
        kept.append(llm)  # still referenced: close() alone must have released everything
        assert not threads() - ts
    assert not open_fds() - fds and not threads() - ts
    del kept, llm
    gc.collect()
    assert not open_fds() - fds and not threads() - ts


# ---------------------------------------------------------------- faults while repacking
SLOW_REPACK = """
import sys, time
import specmoe.experts.repack as r
orig = r.expert_bytes_of
def slow(*a):
    time.sleep(0.05)  # a big checkpoint's repack, on a tiny one: the SIGINT lands mid-repack
    return orig(*a)
r.expert_bytes_of = slow
from specmoe.cli import main
sys.exit(main(["generate", "--model", sys.argv[1], "--offload", "disk", "--repack-dir", sys.argv[2],
               "--prompt", "hi", "--max-tokens", "1"]))
"""


def snapshot(d: Path) -> dict:
    return {p: p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file() and ".specmoe" not in p.parts}


def test_sigint_during_repack_leaves_no_temp_file(tmp_path):
    ck = make_tiny_checkpoint("mixtral", tmp_path / "ck")
    before = snapshot(ck)
    rp = tmp_path / "rp"
    # SIGINT as a terminal delivers it, whatever disposition this test process inherited or a library set
    proc = subprocess.Popen([sys.executable, "-c", SLOW_REPACK, str(ck), str(rp)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=Path(__file__).parents[2],
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 120
    while not list(rp.glob(".*.tmp")):  # the repack is writing its temp file
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.01)
    time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err, err
    assert list(rp.iterdir()) == []  # no temp file, no half manifest
    assert snapshot(ck) == before
    with LLM(ck, offload="disk", repack_dir=rp, cache_experts=2) as llm:  # the next run starts clean
        assert torch.equal(llm.logits([[1, 2, 3]]), LLM(ck).logits([[1, 2, 3]]))
    assert sorted(p.suffix for p in rp.iterdir()) == [".bin", ".json"]


def test_stale_temp_files_of_dead_processes_are_removed(tmp_path):
    ck = make_tiny_checkpoint("mixtral", tmp_path / "ck")
    base = repack.file_base(Checkpoint(ck), torch.float32)
    rp = tmp_path / "rp"
    rp.mkdir()
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    stale = rp / f".{base}.bin.{dead}.tmp"  # a repack killed with SIGKILL leaves this
    stale.write_bytes(b"x" * 1000)
    busy = rp / f".{base}.bin.1.tmp"  # pid 1 is alive: another process's repack in progress, left alone
    busy.write_bytes(b"y")
    LLM(ck, offload="disk", repack_dir=rp).close()
    assert not stale.exists() and busy.exists()


def test_disk_full_while_repacking_is_a_clean_error(tmp_path, monkeypatch):
    ck = make_tiny_checkpoint("mixtral", tmp_path / "ck")
    before = snapshot(ck)
    rp = tmp_path / "rp"
    real_write, written = os.write, [0]

    def fill_up(fd, data):  # the disk fills after 20 KB of the repack
        if written[0] > 20_000:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        written[0] += len(data)
        return real_write(fd, data)
    monkeypatch.setattr(repack.os, "write", fill_up)
    with pytest.raises(InputError, match=f"cannot write the expert repack file in {rp}: no space left on device"):
        LLM(ck, offload="disk", repack_dir=rp)
    assert written[0] > 20_000 and list(rp.iterdir()) == [] and snapshot(ck) == before


def mount_tmpfs(d: Path, opts: str) -> None:
    d.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", str(d)], capture_output=True, text=True)
    if r.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip()}")


def test_full_and_read_only_repack_locations_give_clean_errors(tmp_path, monkeypatch):
    """Real filesystems: a 64 KiB tmpfs (too small for the repack) and a read-only one."""
    ck = make_tiny_checkpoint("mixtral", tmp_path / "ck")
    before = snapshot(ck)
    small, ro = tmp_path / "small", tmp_path / "ro"
    mount_tmpfs(small, "size=64k")
    try:
        mount_tmpfs(ro, "ro,size=1m")
        try:
            with pytest.raises(InputError, match=f"{small} \\(.* free, the repack needs .*\\).*repack_dir"):
                LLM(ck, offload="disk", repack_dir=small)
            with pytest.raises(InputError, match=f"{ro}/sub \\(Read-only file system\\)"):
                LLM(ck, offload="disk", repack_dir=ro / "sub")
            assert list(small.iterdir()) == [] and list(ro.iterdir()) == []
            # without repack_dir a read-only checkpoint location falls back to the user cache, with a message
            monkeypatch.setenv("HOME", str(tmp_path / "home"))
            monkeypatch.setattr(repack, "candidate_dirs", lambda c, d: [ro / ".specmoe", tmp_path / "home" / "c"])
            with pytest.warns(UserWarning, match="Read-only file system.*repacking into"):
                LLM(ck, offload="disk").close()
            assert list((tmp_path / "home" / "c").glob("*.bin"))
        finally:
            subprocess.run(["umount", str(ro)])
    finally:
        subprocess.run(["umount", str(small)])
    assert snapshot(ck) == before


# ---------------------------------------------------------------- oracle prefetch outside the benchmark
def test_cli_prefetch_oracle_is_a_one_line_error(tiny_ckpt):
    r = subprocess.run([sys.executable, "-m", "specmoe", "generate", "--model", str(tiny_ckpt("mixtral")),
                        "--offload", "host", "--prefetch", "oracle", "--prompt", "hi", "--max-tokens", "1"],
                       capture_output=True, text=True, timeout=300, cwd=Path(__file__).parents[2])
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 and "--prefetch oracle" in r.stderr and "bench" in r.stderr


def test_oracle_trace_never_replayed_stays_bounded(tiny_ckpt, monkeypatch):
    from specmoe.experts import oracle
    monkeypatch.setattr(oracle, "ORACLE_TRACE_MAX", 40)
    llm = LLM(tiny_ckpt("mixtral"), offload="host", cache_policy="ondemand", cache_experts=8, prefetch="oracle")
    ref = LLM(tiny_ckpt("mixtral")).generate([[1, 2, 3]], SamplingParams(max_tokens=30))
    for _ in range(3):  # an API user who never replays: the trace stops at the bound
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=30))
    assert len(llm.store.oracle.trace) == 40
    llm.store.start_oracle_replay()  # a replay past the recorded part stops prefetching, still exact
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=30))
    assert out[0].token_ids == ref[0].token_ids and llm.stats["prefetch_useful"] > 0
    llm.close()


def test_close_waits_for_a_generate_running_in_another_thread(tiny_ckpt, tmp_path):
    """close() from another thread never pulls the experts out from under a running generate."""
    import threading
    import time as _time

    from specmoe import LLM, SamplingParams
    from specmoe.errors import InputError
    path = tiny_ckpt("mixtral")
    sp = SamplingParams(max_tokens=40, ignore_eos=True)
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    ref = [o.token_ids for o in LLM(path).generate(prompts, sp)]
    llm = LLM(path, offload="disk", cache_experts=2, repack_dir=str(tmp_path / "r"))
    got = {}
    t = threading.Thread(target=lambda: got.setdefault("out", [o.token_ids for o in llm.generate(prompts, sp)]))
    t.start()
    deadline = _time.monotonic() + 30
    while not llm._lock.locked() and t.is_alive() and _time.monotonic() < deadline:
        _time.sleep(0.001)
    assert llm._lock.locked(), "the generate is running when close() is called"
    llm.close()
    t.join()
    assert got["out"] == ref
    with pytest.raises(InputError, match="closed"):
        llm.generate(prompts, sp)
