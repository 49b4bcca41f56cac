"""What the OS sees of a benchmark run on a model larger than RAM: process memory (/proc/<pid>/status), the bytes a
process read from storage (/proc/<pid>/io), device reads (/proc/diskstats), how much of a file sits in the page
cache (mincore over a read-only mapping) and dropping it from there (posix_fadvise DONTNEED), a per-token
timeline of the running process, and the balloon: a helper process holding N GiB so the page cache shrinks as on
a smaller machine.

Standard library only (ctypes for mmap / mincore / mlock / prctl): the llama.cpp child loads this file by path so
that it does not import torch (which importing the specmoe package would), whose pages would count in its
footprint.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

GiB = 1 << 30
PAGE = os.sysconf("SC_PAGE_SIZE")
_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long)
_libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
_libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)


# ---------------------------------------------------------------- /proc readers
def _kv_kib(path: str, keys: tuple[str, ...]) -> dict[str, int]:
    """{key: bytes} of the 'Key:  123 kB' lines of a /proc file."""
    out = {}
    with open(path) as fh:
        for line in fh:
            k, _, v = line.partition(":")
            if k in keys:
                out[k] = int(v.split()[0]) * 1024
    return out


def meminfo() -> dict[str, int]:
    """MemTotal, MemAvailable, Cached, Dirty (bytes)."""
    return _kv_kib("/proc/meminfo", ("MemTotal", "MemAvailable", "Cached", "Dirty"))


def proc_status(pid: int | str = "self") -> dict[str, int]:
    """VmRSS, VmHWM (peak RSS), RssAnon, RssFile, RssShmem (bytes) of a process."""
    return _kv_kib(f"/proc/{pid}/status", ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem"))


def proc_io(pid: int | str = "self") -> dict[str, int]:
    """read_bytes (what the process made the block layer fetch: its reads, O_DIRECT ones and the page faults of its
    mappings included), rchar, write_bytes."""
    out = {}
    with open(f"/proc/{pid}/io") as fh:
        for line in fh:
            k, _, v = line.partition(":")
            out[k.strip()] = int(v)
    return {k: out[k] for k in ("read_bytes", "rchar", "write_bytes") if k in out}


def device_of(path: str | Path) -> str | None:
    """The block device name (e.g. 'vda', 'nvme0n1') /proc/diskstats lists for the filesystem holding `path`."""
    st = os.stat(path)
    sysfs = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}")
    return sysfs.resolve().name if sysfs.exists() else None


def disk_read_bytes(device: str | None) -> int | None:
    """Bytes read from `device` since boot (/proc/diskstats sectors read × 512; every process counts)."""
    if device is None:
        return None
    with open("/proc/diskstats") as fh:
        for line in fh:
            f = line.split()
            if len(f) > 5 and f[2] == device:
                return int(f[5]) * 512
    return None


# ---------------------------------------------------------------- page cache
def residency(path: str | Path) -> dict[str, int]:
    """{"resident_bytes", "file_bytes"}: how much of `path` sits in the page cache (mincore over a read-only
    shared mapping of the whole file; mapping reads nothing)."""
    size = os.path.getsize(path)
    if size == 0:
        return {"resident_bytes": 0, "file_bytes": 0}
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        if addr in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"mmap of {path} failed")
        try:
            pages = (size + PAGE - 1) // PAGE
            vec = (ctypes.c_ubyte * pages)()
            if _libc.mincore(addr, size, vec) != 0:
                raise OSError(ctypes.get_errno(), f"mincore of {path} failed")
            resident = bytes(vec).translate(_BIT0).count(1) * PAGE
        finally:
            _libc.munmap(addr, size)
    finally:
        os.close(fd)
    return {"resident_bytes": min(resident, size), "file_bytes": size}


_BIT0 = bytes(b & 1 for b in range(256))  # mincore sets bit 0 of a resident page's byte


def drop_cache(path: str | Path) -> dict[str, int]:
    """Write back and drop `path`'s pages from the page cache (fdatasync, posix_fadvise DONTNEED over the file);
    returns its residency afterwards (pages mapped by a running process stay)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return residency(path)


def allocation(path: str | Path) -> dict[str, int]:
    """{"apparent_bytes", "allocated_bytes"} (st_size vs st_blocks × 512, what `du` shows): a sparse file
    allocates less than its size."""
    st = os.stat(path)
    return {"apparent_bytes": st.st_size, "allocated_bytes": st.st_blocks * 512}


# ---------------------------------------------------------------- per-token timeline
@dataclass
class Timeline:
    """Per-token records of the running process: (seconds since `start`, tokens so far, read_bytes so far, RssAnon,
    RssFile). `mark(tokens)` after each decode step (several tokens at once under speculation)."""
    t0: float = 0.0
    io0: int = 0
    records: list[tuple[float, int, int, int, int]] = field(default_factory=list)

    def start(self) -> None:
        self.records.clear()
        self.io0 = proc_io()["read_bytes"]
        self.t0 = time.perf_counter()

    def mark(self, tokens: int) -> None:
        t = time.perf_counter() - self.t0
        st = proc_status()
        self.records.append((t, tokens, proc_io()["read_bytes"] - self.io0, st["RssAnon"], st["RssFile"]))

    def summary(self, window: int) -> dict:
        """Throughput and storage reads of the first `window` tokens (time from the start, so the prefill is
        in it; also given alone as prefill_s) and of the tokens after them (from the record where `window` was
        reached to the last); the footprint (RssAnon + RssFile) over the records past the window."""
        import statistics
        r = self.records
        if not r:
            return {}
        t_end, n_end, b_end = r[-1][:3]
        k = next((i for i, x in enumerate(r) if x[1] >= window), len(r) - 1)
        tk, nk, bk = r[k][:3]
        steady = r[k:] if n_end > nk else r
        foot = [a + f for _, _, _, a, f in steady]
        return {"tokens": n_end, "wall_s": t_end, "prefill_s": r[0][0], "first_tokens": nk, "first_s": tk,
                "steady_s": t_end - tk if n_end > nk else 0.0, "first_read_bytes": bk, "steady_read_bytes": b_end - bk,
                "first_tok_s": nk / tk if tk > 0 else None,
                "steady_tokens": n_end - nk,
                "steady_tok_s": (n_end - nk) / (t_end - tk) if n_end > nk and t_end > tk else None,
                "read_bytes": b_end, "read_bytes_per_token": b_end / n_end if n_end else None,
                "first_read_bytes_per_token": bk / nk if nk else None,
                "steady_read_bytes_per_token": (b_end - bk) / (n_end - nk) if n_end > nk else None,
                "steady_footprint_bytes": statistics.median(foot),
                "steady_rss_anon_bytes": statistics.median(a for *_, a, _ in steady),
                "steady_rss_file_bytes": statistics.median(f for *_, f in steady)}


def combine(summaries: list[dict]) -> dict:
    """Timeline summaries of several requests run one after another, as one: tokens, seconds and bytes summed
    (rates = sum ÷ sum), footprints the median of theirs; each kept under "per_document"."""
    import statistics
    s = [x for x in summaries if x]
    if not s:
        return {}
    tot = {k: sum(x[k] for x in s) for k in ("tokens", "wall_s", "prefill_s", "first_tokens", "first_s",
                                             "steady_tokens", "steady_s", "read_bytes", "first_read_bytes",
                                             "steady_read_bytes")}
    out = {**tot, "first_tok_s": tot["first_tokens"] / tot["first_s"] if tot["first_s"] > 0 else None,
           "steady_tok_s": tot["steady_tokens"] / tot["steady_s"] if tot["steady_s"] > 0 else None,
           "read_bytes_per_token": tot["read_bytes"] / tot["tokens"] if tot["tokens"] else None,
           "first_read_bytes_per_token": tot["first_read_bytes"] / tot["first_tokens"] if tot["first_tokens"] else None,
           "steady_read_bytes_per_token": (tot["steady_read_bytes"] / tot["steady_tokens"] if tot["steady_tokens"]
                                           else None)}
    for k in ("steady_footprint_bytes", "steady_rss_anon_bytes", "steady_rss_file_bytes"):
        out[k] = statistics.median(x[k] for x in s)
    out["per_document"] = [{k: x[k] for k in ("tokens", "first_tok_s", "steady_tok_s", "steady_read_bytes_per_token")}
                           for x in s]
    return out


# ---------------------------------------------------------------- sampling another process
class Sampler:
    """Polls a process's /proc status and the machine's MemAvailable every `interval` seconds on a thread: peaks
    of VmRSS / RssAnon / RssFile, the lowest MemAvailable, and a sample every `keep_every` seconds."""

    def __init__(self, pid: int, interval: float = 0.2, keep_every: float = 2.0):
        self.pid, self.interval, self.keep_every = pid, interval, keep_every
        self.peak = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
        self.min_available: int | None = None
        self.samples: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._t0 = time.perf_counter()

    def __enter__(self) -> "Sampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        last = -1e9
        while not self._stop.is_set():
            try:
                st = proc_status(self.pid)
            except (OSError, ValueError, IndexError):
                st = None
            avail = meminfo()["MemAvailable"]
            self.min_available = avail if self.min_available is None else min(self.min_available, avail)
            t = time.perf_counter() - self._t0
            if st:
                for k in self.peak:
                    self.peak[k] = max(self.peak[k], st.get(k, 0))
                if t - last >= self.keep_every:
                    self.samples.append({"t": round(t, 2), "rss_anon": st.get("RssAnon"), "rss_file": st.get("RssFile"),
                                         "mem_available": avail})
                    last = t
            self._stop.wait(self.interval)

    def result(self) -> dict:
        return {"peak_rss_bytes": self.peak["VmRSS"], "peak_rss_anon_bytes": self.peak["RssAnon"],
                "peak_rss_file_bytes": self.peak["RssFile"], "min_mem_available_bytes": self.min_available,
                "samples": self.samples}


# ---------------------------------------------------------------- the balloon
_BALLOON = r"""
import ctypes, ctypes.util, mmap, sys, time
libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
libc.prctl(1, 9)  # PR_SET_PDEATHSIG = SIGKILL: the balloon dies with the benchmark, however it ends
n = int(sys.argv[1])
m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
page = mmap.PAGESIZE
for off in range(0, n, page):
    m[off] = 1
addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
locked = libc.mlock(ctypes.c_void_p(addr), ctypes.c_size_t(n)) == 0
print("ready", int(locked), ctypes.get_errno(), flush=True)
v = 1
while True:  # without mlock: keep every page recently used, so reclaim takes the page cache first
    time.sleep(2.0)
    if not locked:
        v = v % 250 + 1
        for off in range(0, n, page):
            m[off] = v
"""


class Balloon:
    """`with Balloon(gib, floor_gib):` a helper process holds `gib` GiB of touched anonymous memory (mlocked where
    allowed, else touched every 2 s) so the page cache shrinks as on a machine with that much less RAM; it dies
    with the benchmark (killed on exit, on an exception, and by PR_SET_PDEATHSIG if the benchmark itself is
    killed). Refused (InputError, with the numbers) when MemAvailable after it would fall below `floor_gib`."""

    def __init__(self, gib: float, floor_gib: float = 3.0):
        self.nbytes = int(gib * GiB)
        self.floor = int(floor_gib * GiB)
        self.proc: subprocess.Popen | None = None
        self.info: dict = {"gib": gib, "label": label(gib)}

    def __enter__(self) -> "Balloon":
        if self.nbytes <= 0:
            return self
        avail = meminfo()["MemAvailable"]
        if avail - self.nbytes < self.floor:
            from specmoe.errors import InputError
            raise InputError(f"balloon of {self.nbytes / GiB:.2f} GiB refused: MemAvailable is {avail / GiB:.2f} GiB, "
                             f"which would leave {(avail - self.nbytes) / GiB:.2f} GiB, below the floor of "
                             f"{self.floor / GiB:.2f} GiB")
        t0 = time.perf_counter()
        self.proc = subprocess.Popen([sys.executable, "-c", _BALLOON, str(self.nbytes)], stdout=subprocess.PIPE,
                                     text=True)
        line = self.proc.stdout.readline().split()
        if not line or line[0] != "ready":
            self.__exit__(None, None, None)
            raise RuntimeError(f"the balloon process did not start (exit status {self.proc.poll()})")
        st = proc_status(self.proc.pid)
        self.info.update({"pid": self.proc.pid, "mlocked": line[1] == "1", "mlock_errno": int(line[2]),
                          "rss_anon_bytes": st.get("RssAnon"), "fill_s": time.perf_counter() - t0,
                          "mem_available_after_bytes": meminfo()["MemAvailable"]})
        self._old = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP)}
        for s in self._old:  # a polite kill of the benchmark unwinds through __exit__ too
            signal.signal(s, _raise_exit)
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
            for s, h in getattr(self, "_old", {}).items():
                signal.signal(s, h)

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def _raise_exit(signum, frame):
    raise SystemExit(128 + signum)


def label(gib: float) -> str:
    """The label every output carries for a run under a balloon."""
    return f"emulated smaller RAM (balloon {round(gib, 2):g} GiB)" if gib > 0 else "full RAM (no balloon)"
