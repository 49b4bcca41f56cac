"""specmoe.bench.cgroup against a fake cgroup root in a tmp dir (the limit written and read back, a child's pid
written into cgroup.procs before it runs, stragglers moved out and the directory removed, also when the block
raises), the OOM classification, and a real cgroup where this machine has the v1 memory controller as root."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from specmoe.bench import cgroup
from specmoe.bench.cgroup import MemCgroup, classify_exit


@pytest.fixture
def fake_root(tmp_path, monkeypatch):
    root = tmp_path / "memory"
    root.mkdir()
    (root / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (root / "cgroup.procs").write_text("")
    removed = []

    def rmdir(path):  # the kernel removes a cgroup's control files with it; a plain directory keeps them
        import shutil
        removed.append(Path(path).name)
        shutil.rmtree(path)
    monkeypatch.setattr(cgroup, "_rmdir", rmdir)
    return root, removed


def test_limit_written_pid_written_and_removed(fake_root):
    root, removed = fake_root
    with MemCgroup("run1", 123 << 20, root) as cg:
        assert (root / "run1" / "memory.limit_in_bytes").read_text() == str(123 << 20)
        assert cg.limit_read_back == 123 << 20
        proc = subprocess.Popen([sys.executable, "-c", "pass"], preexec_fn=cg.preexec)
        proc.wait()
        assert (root / "run1" / "cgroup.procs").read_text() == str(proc.pid)  # the child wrote its own pid
        (root / "run1" / "memory.stat").write_text("cache 10\nrss 20\ntotal_pgmajfault 3\nunrelated 4\n")
        (root / "run1" / "memory.failcnt").write_text("2\n")
        (root / "run1" / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
        st = cg.stats()
        assert st["memory_stat"] == {"cache": 10, "rss": 20, "total_pgmajfault": 3}
        assert st["failcnt"] == 2 and st["oom_control"]["oom_kill"] == 1 and st["max_usage_bytes"] is None
    assert removed == ["run1"] and not (root / "run1").exists()
    # the straggler was moved to the parent before the removal
    assert (root / "cgroup.procs").read_text() == str(proc.pid)


def test_cleanup_on_an_exception_and_refusals(fake_root):
    root, removed = fake_root
    with pytest.raises(RuntimeError, match="boom"):
        with MemCgroup("run2", 1 << 30, root):
            raise RuntimeError("boom")
    assert removed == ["run2"] and not (root / "run2").exists()
    from specmoe.errors import InputError
    with pytest.raises(InputError, match="limit must be positive"):
        MemCgroup("x", 0, root)
    (root / "taken").mkdir()
    with pytest.raises(FileExistsError):
        with MemCgroup("taken", 1 << 30, root):
            pass
    assert (root / "taken").is_dir() and removed == ["run2"]  # another run's cgroup is not ours to remove


def test_unavailable_says_why(tmp_path, fake_root):
    root, _ = fake_root
    assert cgroup.unavailable(root) is None or os.geteuid() != 0
    assert "no cgroup v1 memory controller" in cgroup.unavailable(tmp_path / "nothing")


def test_oom_classification():
    hit = {"failcnt": 5, "oom_control": {"oom_kill": 1}}
    assert classify_exit(0, hit) == "ok"
    assert classify_exit(-signal.SIGKILL, hit) == "oom"
    assert classify_exit(-signal.SIGKILL, {"failcnt": 3, "oom_control": {}}) == "oom"  # kernels without oom_kill
    assert classify_exit(-signal.SIGKILL, {"failcnt": 0, "oom_control": {"oom_kill": 0}}) == "error"  # a kill, no limit
    assert classify_exit(1, hit) == "error"  # a crash inside a full cgroup is still a crash
    assert classify_exit(-signal.SIGKILL, None) == "error"


@pytest.mark.skipif(cgroup.unavailable() is not None, reason="no usable cgroup v1 memory controller here")
def test_a_real_cgroup_kills_a_child_over_its_limit_and_run_child_says_oom(tmp_path):
    """64 MiB limit, a child touching 512 MiB of anonymous memory (no swap here): killed, recorded as "oom"."""
    from specmoe.bench import overram_runs
    f = tmp_path / "f.bin"
    f.write_bytes(b"x")
    name = f"specmoe-test-{os.getpid()}"
    with MemCgroup(name, 64 << 20) as cg:
        res = overram_runs.run_child([sys.executable, "-c", "b = bytearray(512 << 20); b[::4096] = b'1' * (512 << 8)"],
                                     env=dict(os.environ), files={"f": f}, device=None, log=tmp_path / "log",
                                     timeout=120, cgroup=cg)
        assert res["status"] == "oom", res.get("reason")
        assert res["cgroup"]["failcnt"] > 0 and res["cgroup"]["limit_bytes"] == 64 << 20
    assert not (cgroup.ROOT / name).exists()
