"""Helpers for the hostile-input tests: a private copy of a tiny checkpoint per test, a hash of
every file in it (to prove a failure changed nothing outside the repack directory), and the CLI
run both in a subprocess (no traceback, exit 2, one line) and in-process (fast, for many cases)."""
from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from specmoe.engine.llm import DEMO_MODEL

ROOT = Path(__file__).resolve().parents[2]
REPACK = ".specmoe"  # the default repack / side-file directory inside a checkpoint
NO_REPACK = shutil.ignore_patterns(REPACK)  # copies start without side files other tests left in the source


def snapshot(path: Path) -> dict[str, str]:
    """sha256 of every file under path, except the repack directory."""
    out = {}
    for p in sorted(Path(path).rglob("*")):
        rel = p.relative_to(path)
        if p.is_file() and rel.parts[0] != REPACK:
            out[str(rel)] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


@pytest.fixture
def ckpt(tmp_path, tiny_ckpt):
    """A private copy of a tiny qwen3_moe checkpoint (fp32, 96-token vocabulary, no tokenizer)."""
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt("qwen3_moe"), dst, ignore=NO_REPACK)
    return dst


@pytest.fixture
def text_ckpt(tmp_path, tiny_ckpt):
    """A tiny checkpoint with the demo model's tokenizer (its vocabulary size), so text prompts work."""
    dst = tmp_path / "text_ckpt"
    shutil.copytree(tiny_ckpt("qwen3_moe", vocab_size=8192), dst, ignore=NO_REPACK)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_MODEL / name, dst / name)
    return dst


def run_cli(*args, cwd=None) -> subprocess.CompletedProcess:
    """`python -m specmoe ARGS` with this worktree's package first on the path."""
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "specmoe", *map(str, args)], capture_output=True, text=True,
                          timeout=300, cwd=cwd or ROOT, env=env)


def assert_one_line_error(p: subprocess.CompletedProcess, *needles: str) -> None:
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    err = p.stderr.strip()
    assert "Traceback" not in err and err.count("\n") == 0, err
    for n in needles:
        assert n in err, (n, err)


def main_error(capsys, *args) -> str:
    """Run the CLI in-process; it must return 2 with one line on stderr, which is returned."""
    from specmoe.cli import main
    try:
        rc = main([str(a) for a in args])
    except SystemExit as e:  # argparse usage errors
        rc = e.code
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and "Traceback" not in err, (rc, err)
    return err
