"""Facts about this machine that the engine measures once and keeps: `<cache dir>/machine.json`, one entry per key
(each key names what it depends on: CPU model, torch version, thread count, ...). The cache dir is
`$SPECMOE_CACHE_DIR`, else `$XDG_CACHE_HOME/specmoe`, else `~/.cache/specmoe`. Writing is best effort: an
unwritable cache only means measuring again next time."""
from __future__ import annotations

import json
import os
import platform
import time
from collections.abc import Callable
from pathlib import Path

import torch


def cache_file() -> Path:
    base = os.environ.get("SPECMOE_CACHE_DIR")
    if not base:
        xdg = os.environ.get("XDG_CACHE_HOME")
        base = str(Path(xdg) / "specmoe") if xdg else str(Path.home() / ".cache" / "specmoe")
    return Path(base) / "machine.json"


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def machine_key(what: str) -> str:
    """A cache key for `what` measured on this CPU, torch build and thread count."""
    return f"{cpu_model()} | torch {torch.__version__} | {what} | {torch.get_num_threads()} threads"


def _load(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def cached(key: str, measure: Callable[[], dict], valid: Callable[[dict], bool]) -> dict:
    """The entry stored under `key` when `valid` accepts it, else `measure()`'s (stored, with its time)."""
    path = cache_file()
    entry = _load(path).get(key)
    if isinstance(entry, dict) and valid(entry):
        return entry
    entry = {**measure(), "measured": time.time()}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = _load(path)
        data[key] = entry
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data, indent=1))
        os.replace(tmp, path)
    except OSError:
        pass
    return entry
