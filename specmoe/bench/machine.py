"""What the benchmark ran on: CPU, cores, RAM, disk, library versions."""
from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path


def _cpuinfo() -> dict:
    out = {}
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        if ":" not in line:
            continue
        k, v = (s.strip() for s in line.split(":", 1))
        if k == "model name" and "cpu_model" not in out:
            out["cpu_model"] = v
        elif k == "flags" and "cpu_flags" not in out:
            flags = set(v.split())
            out["cpu_flags"] = sorted(f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "fma") if f in flags)
    return out


def _meminfo_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return round(int(line.split()[1]) / 2**20, 1)
    except OSError:
        pass
    return None


def _disk_of(path: Path) -> dict:
    """The block device holding `path` and whether it is rotational (SSD vs HDD)."""
    try:
        dev = os.stat(path).st_dev
        major, minor = os.major(dev), os.minor(dev)
        sysfs = Path(f"/sys/dev/block/{major}:{minor}")
        name = sysfs.resolve().name
        # partitions point at their parent disk's queue
        queue = sysfs / "queue"
        if not queue.exists():
            queue = sysfs.resolve().parent / "queue"
        rot = (queue / "rotational").read_text().strip() if (queue / "rotational").exists() else None
        model_file = sysfs.resolve() / "device" / "model"
        if not model_file.exists():
            model_file = sysfs.resolve().parent / "device" / "model"
        model = model_file.read_text().strip() if model_file.exists() else None
        return {"device": name, "rotational": None if rot is None else rot == "1", "model": model}
    except OSError as e:
        return {"error": str(e)}


def _load() -> list[float] | None:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def machine_info(model_path: str | Path | None = None) -> dict:
    import torch
    info = {"hostname": platform.node(), "platform": platform.platform(), "python": platform.python_version(),
            **_cpuinfo(), "logical_cores": os.cpu_count(),
            "usable_cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            "torch_threads": torch.get_num_threads(), "ram_gib": _meminfo_gib(),
            "torch": torch.__version__, "cuda": torch.cuda.is_available(), "loadavg_at_start": _load()}
    for mod in ("transformers", "accelerate", "llama_cpp", "numpy", "safetensors"):
        try:
            m = __import__(mod)
            info[mod] = getattr(m, "__version__", "?")
        except ImportError:
            info[mod] = None
    if model_path is not None:
        info["model_disk"] = _disk_of(Path(model_path))
    info.update(git_state())
    return info


def git_state() -> dict:
    """The commit the code was measured at and whether `specmoe/` differed from it (uncommitted changes):
    {"git_commit": hash or None, "git_dirty": bool or None}. None where git or the repository is missing
    (an installed wheel)."""
    here = Path(__file__).resolve().parents[1]  # specmoe/

    def git(*args):
        return subprocess.run(["git", *args], capture_output=True, text=True, cwd=here, timeout=5)
    try:
        commit = git("rev-parse", "HEAD").stdout.strip() or None
        dirty = bool(git("status", "--porcelain", "--", str(here)).stdout.strip()) if commit else None
    except (OSError, subprocess.SubprocessError):
        commit = dirty = None
    return {"git_commit": commit, "git_dirty": dirty}


def provenance() -> dict:
    """What a results file records about where and at which code it was measured (every benchmark writes this
    under "provenance"): commit, uncommitted changes to specmoe/, CPU, cores, platform, torch."""
    import torch
    cpu = _cpuinfo()
    return {**git_state(), "cpu_model": cpu.get("cpu_model") or platform.processor() or None,
            "logical_cores": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__,
            "cuda_device": torch.cuda.get_device_name() if torch.cuda.is_available() else None}
