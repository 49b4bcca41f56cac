"""Byte sizes, aligned host buffers, checks against the memory the machine has, and the memory limit this
process runs under (its cgroup's, or what the host has available)."""
from __future__ import annotations

import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from specmoe.errors import InputError, MemoryBudgetError

ALIGN = 4096  # O_DIRECT wants buffer address, file offset and length aligned to the logical block size

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 2**10, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


class SizeError(InputError, ValueError):
    """A byte size that does not parse (a ValueError too, so argparse reports it as a bad flag value)."""


def parse_size(value) -> int | None:
    """'512MiB', '2GB', '1.5e9', 4096 -> bytes (None stays None)."""
    if value is None or isinstance(value, int):
        return value
    if isinstance(value, float):
        return int(value)
    m = re.fullmatch(r"\s*([0-9.eE+]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise SizeError(f"cannot read {value!r} as a byte size (examples: 4096, 512MiB, 2GB)")
    try:
        return int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    except ValueError:
        raise SizeError(f"cannot read {value!r} as a byte size (examples: 4096, 512MiB, 2GB)") from None


def round_up(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


def fmt_bytes(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def host_memory() -> tuple[int, int]:
    """(physical bytes, available bytes) of this machine."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    avail = total
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    return total, avail


def device_memory(device: torch.device) -> tuple[int, int]:
    """(total, free) bytes of the compute device's memory (host RAM on CPU)."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return total, free
    return host_memory()


def check_fits(what: str, nbytes: int, device: torch.device, *, budget: int | None = None) -> None:
    """Raise MemoryBudgetError before allocating `nbytes` of `what` that cannot fit."""
    total, avail = device_memory(device)
    where = "GPU" if device.type == "cuda" else "host"
    if budget is not None and nbytes > budget:
        raise MemoryBudgetError(f"{what} needs {fmt_bytes(nbytes)}, more than memory_budget={fmt_bytes(budget)}; "
                                "lower cache_experts/cache_bytes or raise memory_budget")
    if nbytes > total:
        raise MemoryBudgetError(f"{what} needs {fmt_bytes(nbytes)}, more than the {fmt_bytes(total)} of {where} "
                                "memory this machine has")
    if nbytes > avail:
        raise MemoryBudgetError(f"{what} needs {fmt_bytes(nbytes)}; only {fmt_bytes(avail)} of {where} memory is "
                                "available now")


def check_budget_value(name: str, nbytes: int | None, device: torch.device) -> None:
    """A budget the user set must not exceed the machine's memory (checked before any allocation)."""
    if nbytes is None:
        return
    if nbytes <= 0:
        raise InputError(f"{name} must be positive, got {nbytes}")
    total, _ = device_memory(device)
    if nbytes > total:
        where = "GPU" if device.type == "cuda" else "host"
        raise MemoryBudgetError(f"{name}={fmt_bytes(nbytes)} is larger than the {fmt_bytes(total)} of {where} "
                                "memory this machine has")


HUGE = 2 << 20  # a transparent huge page on x86-64 and arm64 (4 KiB base pages)


def _huge_mapping(nbytes: int) -> torch.Tensor | None:
    """A uint8 tensor of `nbytes` in its own anonymous private mapping, starting on a HUGE boundary and advised
    MADV_HUGEPAGE, so the kernel backs it with transparent huge pages where it can (THP "madvise" or "always");
    None where mmap or madvise cannot do it (then the caller falls back to the allocator).

    Why: a direct (O_DIRECT) read pins and maps every page of its destination for the transfer. Into 4 KiB pages
    that is ~1500 pages per 6 MiB expert, and on a virtual machine whether those guest pages happen to sit on host
    huge pages moved one buffer's reads by 1.3-1.5x against another's (`benchmarks/hugepage_io.py` measures it).
    Huge-page rows make every engine's rows alike, and fast. The mapping is freed with the last tensor that views
    it (torch.frombuffer holds a reference to it); its pages are faulted in (committed) here, when allocated."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return None
    try:
        span = round_up(nbytes + HUGE, mmap.PAGESIZE)
        m = mmap.mmap(-1, span + mmap.PAGESIZE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        # all but the last page: that page keeps the default flags, so the kernel never merges two of these
        # mappings into one (adjacent mappings with equal flags merge), and smaps counts each buffer's own
        m.madvise(mmap.MADV_HUGEPAGE, 0, span)
    except (OSError, ValueError):
        return None
    raw = torch.frombuffer(m, dtype=torch.uint8)
    off = (-raw.data_ptr()) % HUGE
    out = raw[off: off + nbytes]
    out.zero_()  # fault the pages in now (as huge pages where the kernel can), not on the first read
    return out


def huge_backed_bytes(tensors) -> int:
    """Bytes of the mappings holding these CPU tensors' first bytes that the kernel backs with transparent huge
    pages now (AnonHugePages of each mapping in /proc/self/smaps, each mapping counted once); 0 where unreadable."""
    ptrs = {t.data_ptr() for t in tensors if t.device.type == "cpu" and t.numel()}
    if not ptrs:
        return 0
    total, hit = 0, False
    try:
        with open(FS_ROOT / "proc/self/smaps") as f:
            for line in f:
                head = line.split(None, 1)[0]
                if "-" in head and not head.endswith(":"):
                    lo, hi = (int(x, 16) for x in head.split("-"))
                    hit = any(lo <= p < hi for p in ptrs)
                elif hit and head == "AnonHugePages:":
                    total += int(line.split()[1]) * 1024
    except (OSError, ValueError):
        return 0
    return total


def huge_pages_mode() -> str:
    """The kernel's transparent-huge-page mode ("always", "madvise", "never"; "unknown" where unreadable)."""
    try:
        text = (FS_ROOT / "sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "unknown"
    m = re.search(r"\[(\w+)\]", text)
    return m.group(1) if m else "unknown"


def aligned_empty(nbytes: int, *, pin: bool = False, huge: bool = True) -> torch.Tensor:
    """A uint8 CPU tensor of `nbytes` whose first byte sits on an ALIGN boundary. Unpinned buffers of a huge page
    or more (`huge`) get a mapping of their own backed by transparent huge pages (`_huge_mapping`)."""
    if huge and not pin and nbytes >= HUGE:
        out = _huge_mapping(nbytes)
        if out is not None:
            return out
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    off = (-raw.data_ptr()) % ALIGN
    out = raw[off: off + nbytes]
    assert out.data_ptr() % ALIGN == 0, "alignment failed"
    return out


FS_ROOT = Path("/")  # where /proc and /sys/fs/cgroup are read from (tests point it at a fake tree)
# cgroup v1 reports "no limit" as the page counter's maximum rounded down to a page (9223372036854771712 with 4 KiB
# pages); anything this large is no limit
NO_LIMIT = 2**62


@dataclass(frozen=True)
class MemoryLimit:
    """What bounds this process's memory: `cgroup_bytes` (the tightest limit of its memory cgroup and the cgroups
    above it; None: none set), read from `cgroup_file` (`cgroup` is "v1" or "v2"), and the host's MemAvailable
    (`available_bytes`); `used_bytes`: what the process holds already (its resident set), which the cgroup limit
    also counts."""
    cgroup: str | None
    cgroup_bytes: int | None
    cgroup_file: str | None
    available_bytes: int
    used_bytes: int = 0

    @property
    def room(self) -> int:
        """Bytes this process may still take: the smaller of what the cgroup leaves and MemAvailable."""
        left = self.available_bytes
        if self.cgroup_bytes is not None:
            left = min(left, self.cgroup_bytes - self.used_bytes)
        return max(0, left)

    @property
    def bound_by(self) -> str:
        """Which of the two bounds `room`: 'cgroup v1' / 'cgroup v2' or 'MemAvailable'."""
        if self.cgroup_bytes is not None and self.cgroup_bytes - self.used_bytes <= self.available_bytes:
            return f"cgroup {self.cgroup}"
        return "MemAvailable"

    def describe(self) -> str:
        """'cgroup v1 memory.limit_in_bytes 2.00 GiB (/sys/fs/cgroup/memory/x/memory.limit_in_bytes) less 0.31 GiB
        in use' or 'MemAvailable 12.0 GiB'."""
        if self.bound_by == "MemAvailable":
            return f"MemAvailable {fmt_bytes(self.available_bytes)}"
        return (f"cgroup {self.cgroup} limit {fmt_bytes(self.cgroup_bytes)} ({self.cgroup_file}) less "
                f"{fmt_bytes(self.used_bytes)} this process holds")

    def to_dict(self) -> dict:
        return {"cgroup": self.cgroup, "cgroup_limit_bytes": self.cgroup_bytes, "cgroup_file": self.cgroup_file,
                "mem_available_bytes": self.available_bytes, "process_rss_bytes": self.used_bytes,
                "room_bytes": self.room, "bound_by": self.bound_by}


def _read_limit(path: Path) -> int | None:
    """A memory.limit_in_bytes / memory.max file: bytes, or None for no limit ('max', the v1 sentinel) or a file
    that is missing or unreadable."""
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    if not text.isdigit():  # "max" (v2), or garbage
        return None
    n = int(text)
    return None if n >= NO_LIMIT else n


def cgroup_memory_limit(root: str | Path = "/") -> tuple[str, int, str] | None:
    """The memory limit of this process's cgroup under the file-system `root` (tests point it at a fake tree):
    ("v1" or "v2", bytes, the file it came from), the tightest over the cgroup and its ancestors (a child's limit
    may be set above its parent's), or None when no limit is set or no memory controller is found.

    /proc/self/cgroup names the cgroup: a v1 line "N:...memory...:/path" (limit in
    /sys/fs/cgroup/memory/<path>/memory.limit_in_bytes), else the v2 line "0::/path" (limit in
    /sys/fs/cgroup/<path>/memory.max). Inside a cgroup namespace the path may be missing under the mount: the
    mount's own files are then the process's cgroup's."""
    root = Path(root)
    try:
        lines = (root / "proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    v1 = v2 = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if "memory" in parts[1].split(","):
            v1 = parts[2]
        elif parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
    for kind, rel, mount, name in (("v1", v1, "sys/fs/cgroup/memory", "memory.limit_in_bytes"),
                                   ("v2", v2, "sys/fs/cgroup", "memory.max")):
        if rel is None or not (root / mount).is_dir():
            continue
        best = None
        d = Path(rel.strip("/"))
        while True:
            f = root / mount / d / name
            n = _read_limit(f)
            if n is not None and (best is None or n < best[1]):
                best = (kind, n, "/" + str(f.relative_to(root)))
            if d == Path("."):
                break
            d = d.parent
        if best is not None:
            return best
    return None


def process_rss(root: str | Path = "/") -> int:
    """This process's resident set in bytes, from `root`/proc/self/statm (0 where it is not there)."""
    try:
        return int((Path(root) / "proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def memory_limit(root: str | Path | None = None) -> MemoryLimit:
    """The limit this process runs under now (see MemoryLimit), read under `root` (default: FS_ROOT)."""
    root = Path(FS_ROOT if root is None else root)
    cg = cgroup_memory_limit(root)
    return MemoryLimit(cgroup=cg[0] if cg else None, cgroup_bytes=cg[1] if cg else None,
                       cgroup_file=cg[2] if cg else None, available_bytes=_mem_available(root),
                       used_bytes=process_rss(root) if cg else 0)


def _mem_available(root: Path) -> int:
    """MemAvailable from `root`/proc/meminfo; the host's total memory where it has none."""
    try:
        for line in (root / "proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return host_memory()[0]
