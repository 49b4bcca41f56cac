"""A true memory limit for one benchmark child: a cgroup v1 memory cgroup (issue 36, benchmarks/over_ram.py).

`MemCgroup(name, limit)` makes /sys/fs/cgroup/memory/<name>/, writes memory.limit_in_bytes (read back: the kernel
rounds it to pages), and `preexec` puts a child into it between fork and exec (Popen(preexec_fn=...)), so every
page the child touches from its first instruction on, anonymous or page cache, is charged to it and reclaimed
within the limit. `stats()` reads memory.stat, memory.max_usage_in_bytes, memory.failcnt and memory.oom_control.
`close()` moves any process still inside to the parent cgroup and removes the directory; it runs on leaving the
`with` block however it is left, and `install_signal_exit()` turns SIGTERM / SIGHUP into SystemExit so a polite
kill unwinds through it too (Ctrl-C does already, as KeyboardInterrupt).

`unavailable()` says why no cgroup can be made here (no v1 memory controller mounted, not root); the benchmark
then falls back to its balloon and labels those rows. `classify_exit` tells a child the kernel killed for memory
(SIGKILL with the cgroup's failcnt or oom_kill above 0) from a crash.

Standard library only.
"""
from __future__ import annotations

import errno
import os
import signal
import time
from pathlib import Path

ROOT = Path("/sys/fs/cgroup/memory")
_rmdir = os.rmdir  # the kernel removes a cgroup's control files with it (tests of a fake root replace this)
STAT_KEYS = ("cache", "rss", "rss_huge", "shmem", "mapped_file", "pgpgin", "pgmajfault", "pgfault", "inactive_file",
             "active_file", "inactive_anon", "active_anon", "total_cache", "total_rss", "total_mapped_file",
             "total_pgmajfault", "total_pgfault", "hierarchical_memory_limit")


def unavailable(root: Path = ROOT) -> str | None:
    """None when memory cgroups can be made under `root`, else why not (one line)."""
    root = Path(root)
    if not (root / "memory.limit_in_bytes").is_file():
        return f"no cgroup v1 memory controller at {root} (memory.limit_in_bytes missing)"
    if os.geteuid() != 0 and not os.access(root, os.W_OK):
        return f"not root (euid {os.geteuid()}) and {root} is not writable: cannot make a memory cgroup"
    return None


def _read(path: Path) -> str:
    return path.read_text()


def parse_kv(text: str) -> dict[str, int]:
    """'key value' lines (memory.stat, memory.oom_control) -> {key: int}."""
    out = {}
    for line in text.splitlines():
        k, _, v = line.strip().partition(" ")
        if k and v.strip().lstrip("-").isdigit():
            out[k] = int(v)
    return out


class MemCgroup:
    """One memory cgroup `root/name` limited to `limit_bytes` (see the module docstring)."""

    def __init__(self, name: str, limit_bytes: int, root: Path = ROOT):
        if limit_bytes <= 0:
            from specmoe.errors import InputError
            raise InputError(f"memory cgroup {name!r}: limit must be positive, got {limit_bytes} bytes")
        self.root, self.name, self.limit = Path(root), name, int(limit_bytes)
        self.path = self.root / name
        self.made = False
        self.limit_read_back: int | None = None

    def __enter__(self) -> "MemCgroup":
        self.path.mkdir()  # FileExistsError: a cgroup of that name is live (another run's): not ours to reuse
        self.made = True
        try:
            (self.path / "memory.limit_in_bytes").write_text(str(self.limit))
            self.limit_read_back = int(_read(self.path / "memory.limit_in_bytes").split()[0])
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def preexec(self) -> None:
        """Popen(preexec_fn=...): runs in the child after fork, before exec; joins the cgroup."""
        with open(self.path / "cgroup.procs", "w") as fh:
            fh.write(str(os.getpid()))

    def procs(self) -> list[int]:
        try:
            return [int(x) for x in _read(self.path / "cgroup.procs").split()]
        except FileNotFoundError:
            return []

    def stats(self) -> dict:
        """memory.stat (STAT_KEYS), max_usage_bytes, failcnt, oom_control (oom_kill_disable, under_oom, oom_kill),
        limit_bytes (as the kernel holds it)."""
        p = self.path
        out: dict = {"limit_bytes": self.limit_read_back}
        try:
            st = parse_kv(_read(p / "memory.stat"))
            out["memory_stat"] = {k: st[k] for k in STAT_KEYS if k in st}
        except FileNotFoundError:
            out["memory_stat"] = {}
        for key, fname in (("max_usage_bytes", "memory.max_usage_in_bytes"), ("failcnt", "memory.failcnt")):
            try:
                out[key] = int(_read(p / fname).split()[0])
            except (FileNotFoundError, IndexError, ValueError):
                out[key] = None
        try:
            out["oom_control"] = parse_kv(_read(p / "memory.oom_control"))
        except FileNotFoundError:
            out["oom_control"] = {}
        return out

    def close(self) -> None:
        """Move what is still inside to the parent cgroup, then remove the directory (retried: the kernel may
        still be tearing an exiting process out). Idempotent."""
        if not self.made:
            return
        for pid in self.procs():
            try:
                with open(self.root / "cgroup.procs", "w") as fh:
                    fh.write(str(pid))
            except OSError:  # it exited meanwhile
                pass
        for attempt in range(50):
            try:
                _rmdir(self.path)
                break
            except FileNotFoundError:
                break
            except OSError as e:
                if e.errno not in (errno.EBUSY, errno.ENOTEMPTY) or attempt == 49:
                    raise
                time.sleep(0.1)
        self.made = False


def classify_exit(returncode: int | None, stats: dict | None) -> str:
    """'ok' (exit 0), 'oom' (killed by SIGKILL while its cgroup hit the limit: failcnt or oom_kill > 0), else
    'error'."""
    if returncode == 0:
        return "ok"
    st = stats or {}
    hit = (st.get("failcnt") or 0) > 0 or (st.get("oom_control") or {}).get("oom_kill", 0) > 0
    if returncode in (-signal.SIGKILL, 128 + signal.SIGKILL) and hit:
        return "oom"
    return "error"


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


def install_signal_exit() -> dict:
    """SIGTERM and SIGHUP raise SystemExit in the main thread, so `with MemCgroup` / balloon blocks unwind and
    clean up. Returns the previous handlers."""
    old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
    for s in old:
        signal.signal(s, _raise_exit)
    return old
