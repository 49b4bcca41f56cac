"""Byte sizes, aligned host buffers and checks against the memory the machine has."""
from __future__ import annotations

import os
import re

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


def aligned_empty(nbytes: int, *, pin: bool = False) -> torch.Tensor:
    """A uint8 CPU tensor of `nbytes` whose first byte sits on an ALIGN boundary."""
    raw = torch.empty(nbytes + ALIGN, dtype=torch.uint8, pin_memory=pin)
    off = (-raw.data_ptr()) % ALIGN
    out = raw[off: off + nbytes]
    assert out.data_ptr() % ALIGN == 0, "alignment failed"
    return out
