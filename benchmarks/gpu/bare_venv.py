"""A virtual environment holding only what the GPU kit may count on finding on a device machine, to dry-run the
kit there as it will run on the device (no serve or ray extras, no httpx, fastapi, ray, openai).

    python benchmarks/gpu/bare_venv.py DIR     # then: PYTHON=DIR/bin/python bash benchmarks/gpu/run.sh OUT --device cpu --tiny

No network and no pip: `python -m venv --without-pip DIR`, then the allowed distributions and their own
requirements (read with importlib.metadata from the running interpreter) are symlinked from the running
interpreter's site-packages into DIR's, entry by entry (package folders, modules, extension modules and their
.dist-info; never a .pth file). The project itself is not installed: the kit puts the repository on PYTHONPATH.
"""
from __future__ import annotations

import importlib.metadata as md
import re
import subprocess
import sys
from pathlib import Path

# what the kit needs (benchmarks/gpu/run.sh; xxhash and ninja are in the device image too), plus pytest for
# its test step
ALLOWED = ("torch", "transformers", "safetensors", "tokenizers", "numpy", "tqdm", "matplotlib", "pytest", "xxhash",
           "ninja")
# extras a bare device machine may lack: none of them may be importable in the bare venv
ABSENT = ("httpx", "fastapi", "uvicorn", "ray", "openai", "starlette", "prometheus_client", "accelerate")


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots=ALLOWED) -> dict[str, md.Distribution]:
    """The distributions `roots` name and, transitively, those their unconditional requirements name
    (environment markers evaluated, no extras)."""
    from packaging.requirements import Requirement
    found: dict[str, md.Distribution] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        if _norm(name) in found:
            continue
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            if name in roots:
                raise
            continue  # an optional requirement this interpreter does not have (e.g. a platform-specific one)
        found[_norm(name)] = dist
        for spec in dist.requires or []:
            req = Requirement(spec)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return found


def entries(dist: md.Distribution) -> set[Path]:
    """The top-level entries of site-packages that `dist` installed (from its RECORD), .pth files excluded."""
    base = Path(dist.locate_file(""))
    out = set()
    for f in dist.files or []:
        top = f.parts[0]
        if top in ("..", "__pycache__") or top.endswith(".pth"):
            continue
        out.add(base / top)
    return {p for p in out if p.exists()}


def site_packages(venv: Path) -> Path:
    return venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"


def make(venv: Path, roots=ALLOWED) -> Path:
    """Create the bare venv at `venv` (must not exist); return its python."""
    venv = Path(venv)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = site_packages(venv)
    for dist in closure(roots).values():
        for src in entries(dist):
            dst = site / src.name
            if not dst.exists():
                dst.symlink_to(src, target_is_directory=src.is_dir())
    return venv / "bin" / "python"


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    py = make(Path(sys.argv[1]))
    print(py)
