"""A mutation check: plant each bug of a fixed list (`specmoe.dev.mutants.MUTANTS`) one at a time, run only the
tests that cover it (`pytest -x -q`), and report it caught (the tests failed) or survived (they passed).

    python -m specmoe.dev.mutate                 # every mutant (a baseline run of their tests first)
    python -m specmoe.dev.mutate --list          # the list: name, file, covering tests
    python -m specmoe.dev.mutate --only NAME ... # some of them

The working tree is never modified: the code, tests, benchmarks and docs are copied once to a temporary
directory (the large bundled models are linked, read-only), each mutant is written into that copy and the file
restored from its original bytes in a `finally` (Ctrl-C and SIGTERM included), and pytest runs there with the
copy first on PYTHONPATH and no bytecode written (a restored file is never shadowed by a mutant's .pyc). A mutant
whose original snippet is not exactly once in its file is reported stale, never guessed at. Equivalent mutants
(no test can tell them apart from the original) are listed with the reason and not run. The exit status is 0 when
every mutant that ran was caught.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from specmoe.dev.mutants import MUTANTS, Mutant

REPO = Path(__file__).resolve().parents[2]
COPIED = ("specmoe", "tests", "benchmarks", "scripts", "docs", "README.md", "pyproject.toml", "LICENSE", "Makefile")
LINKED = ("models",)  # large and only read by the covering tests
IGNORE = shutil.ignore_patterns("__pycache__", ".pytest_cache", "*.egg-info", ".specmoe", "*.pyc")


def copy_tree(src: Path, dst: Path) -> Path:
    """The parts of the repository the tests need, copied (or linked: LINKED) under dst."""
    for name in COPIED:
        p = src / name
        if p.is_dir():
            shutil.copytree(p, dst / name, ignore=IGNORE, symlinks=True)
        elif p.is_file():
            shutil.copy2(p, dst / name)
    for name in LINKED:
        if (src / name).exists():
            (dst / name).symlink_to(src / name, target_is_directory=True)
    return dst


def child_env(root: Path, native: bool) -> dict:
    """The test process's environment: the copy imported first, no bytecode written, and (unless `native`) the
    native CPU kernels off (no mutant is in them; each pytest run would otherwise build them in its fresh cache)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), *filter(None, [os.environ.get("PYTHONPATH")])]),
               PYTHONDONTWRITEBYTECODE="1")
    if not native:
        env["SPECMOE_NATIVE"] = "0"
    return env


def run_tests(root: Path, tests: tuple[str, ...], env: dict, timeout: float) -> tuple[str, str, float]:
    """pytest -x -q over `tests` in `root` → (outcome, the line that says why, seconds). Outcomes: "passed",
    "failed" (a test failed: rc 1), "timeout", "error" (no test ran, collection or usage error)."""
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-W", "ignore", *tests]
    try:
        p = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout", f"over {timeout:.0f} s", time.perf_counter() - t0
    dt = time.perf_counter() - t0
    out = (p.stdout + p.stderr).splitlines()
    if p.returncode == 0:
        return "passed", next((x for x in reversed(out) if " passed" in x), ""), dt
    why = next((x for x in out if x.startswith("E  ")), None) or next((x for x in out if x.startswith("FAILED")),
                                                                      None) or (out[-1] if out else "")
    return ("failed" if p.returncode == 1 else "error"), why.strip()[:160], dt


class Planted:
    """Context manager: `mutant` written into its file under `root`; the original bytes back on exit, whatever
    ends the block (an exception, Ctrl-C)."""

    def __init__(self, root: Path, mutant: Mutant):
        self.path, self.mutant = root / mutant.file, mutant
        self.original: bytes | None = None

    def __enter__(self) -> "Planted":
        data = self.path.read_bytes()
        text = data.decode()
        n = text.count(self.mutant.original)
        if n != 1:
            raise StaleMutant(f"{self.mutant.name}: its original snippet is {n} times in {self.mutant.file} (want 1)")
        self.original = data
        self.path.write_text(text.replace(self.mutant.original, self.mutant.replacement))
        return self

    def __exit__(self, *exc) -> None:
        if self.original is not None:
            self.path.write_bytes(self.original)


class StaleMutant(Exception):
    pass


def check(mutants: list[Mutant], root: Path = REPO) -> list[str]:
    """What is wrong with a mutant list against the tree at `root`: duplicate names, snippets not exactly once in
    their file, replacements equal to the original, mutants without tests, test files that do not exist."""
    bad, names = [], set()
    for m in mutants:
        if m.name in names:
            bad.append(f"{m.name}: duplicate name")
        names.add(m.name)
        path = root / m.file
        if not path.is_file():
            bad.append(f"{m.name}: no file {m.file}")
            continue
        n = path.read_text().count(m.original)
        if n != 1:
            bad.append(f"{m.name}: original snippet found {n} times in {m.file}")
        if m.original == m.replacement:
            bad.append(f"{m.name}: replacement equals the original")
        if not m.tests and not m.equivalent:
            bad.append(f"{m.name}: no covering tests")
        for t in m.tests:
            if not (root / t.split("::")[0]).is_file():
                bad.append(f"{m.name}: no test file {t.split('::')[0]}")
    return bad


def select(names: list[str] | None) -> list[Mutant]:
    if not names:
        return list(MUTANTS)
    by = {m.name: m for m in MUTANTS}
    unknown = [n for n in names if n not in by]
    if unknown:
        raise SystemExit(f"unknown mutant(s): {', '.join(unknown)} (see --list)")
    return [by[n] for n in names]


def list_mutants(mutants: list[Mutant]) -> None:
    for m in mutants:
        tag = f"  [equivalent: {m.equivalent}]" if m.equivalent else ""
        print(f"{m.name:34s} {m.area:9s} {m.file}{tag}")
        print(f"{'':34s} {m.why}")
        for t in m.tests:
            print(f"{'':34s}   {t}")
    print(f"{len(mutants)} mutants")


def _sigterm(signum, frame):
    raise KeyboardInterrupt


def run(mutants: list[Mutant], *, timeout: float, baseline: bool, native: bool, src: Path = REPO,
        out=print) -> dict:
    """Plant each mutant in a temporary copy of `src` and run its tests → {"caught": [...], "survived": [...],
    "equivalent": [...], "stale": [...], "errors": [...]} (names)."""
    result = {k: [] for k in ("caught", "survived", "equivalent", "stale", "errors")}
    old = signal.signal(signal.SIGTERM, _sigterm) if hasattr(signal, "SIGTERM") else None
    try:
        with tempfile.TemporaryDirectory(prefix="specmoe-mutate-") as tmp:
            root = copy_tree(src, Path(tmp))
            env = child_env(root, native)
            live = [m for m in mutants if not m.equivalent]
            if baseline and live:
                tests = tuple(dict.fromkeys(t for m in live for t in m.tests))
                outcome, why, dt = run_tests(root, tests, env, timeout * 4)
                out(f"baseline: {len(tests)} test selections on the unmutated copy: {outcome} ({dt:.0f} s) {why}")
                if outcome != "passed":
                    out("the tests fail without any mutant: fix them first (or --no-baseline)")
                    result["errors"].append("baseline")
                    return result
            for i, m in enumerate(mutants, 1):
                head = f"[{i}/{len(mutants)}] {m.name}"
                if m.equivalent:
                    result["equivalent"].append(m.name)
                    out(f"{head}: equivalent, not run ({m.equivalent})")
                    continue
                try:
                    with Planted(root, m):
                        outcome, why, dt = run_tests(root, m.tests, env, timeout)
                except StaleMutant as e:
                    result["stale"].append(m.name)
                    out(f"{head}: STALE {e}")
                    continue
                if outcome in ("failed", "timeout"):
                    result["caught"].append(m.name)
                    out(f"{head}: caught ({dt:.0f} s) {why}")
                elif outcome == "passed":
                    result["survived"].append(m.name)
                    out(f"{head}: SURVIVED ({dt:.0f} s) {why}")
                else:
                    result["errors"].append(m.name)
                    out(f"{head}: ERROR ({dt:.0f} s) {why}")
    finally:
        if old is not None:
            signal.signal(signal.SIGTERM, old)
    return result


def summary(result: dict) -> str:
    ran = len(result["caught"]) + len(result["survived"])
    pct = f"{100 * len(result['caught']) / ran:.0f}%" if ran else "–"
    line = (f"mutants: {ran + len(result['equivalent']) + len(result['stale']) + len(result['errors'])}, "
            f"caught {len(result['caught'])}, survived {len(result['survived'])}, "
            f"equivalent (excluded) {len(result['equivalent'])}, stale {len(result['stale'])}, "
            f"errors {len(result['errors'])}; caught {len(result['caught'])}/{ran} = {pct}")
    if result["survived"]:
        line += "\nsurvived: " + ", ".join(result["survived"])
    return line


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m specmoe.dev.mutate", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--list", action="store_true", help="print the mutants and their covering tests, run nothing")
    p.add_argument("--only", nargs="+", metavar="NAME", help="run only these mutants")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per mutant's test run (a run past it "
                   "counts as caught: the mutant hung the tests)")
    p.add_argument("--no-baseline", action="store_true", help="skip the run of the covering tests unmutated")
    p.add_argument("--native", action="store_true", help="keep the native CPU kernels on (SPECMOE_NATIVE)")
    a = p.parse_args(argv)
    mutants = select(a.only)
    if a.list:
        list_mutants(mutants)
        return 0
    bad = check(mutants)
    if bad:
        print("the mutant list does not match the tree:\n  " + "\n  ".join(bad))
    t0 = time.perf_counter()
    try:
        result = run(mutants, timeout=a.timeout, baseline=not a.no_baseline, native=a.native,
                     out=lambda s: print(s, flush=True))
    except KeyboardInterrupt:
        print("interrupted: every planted file was restored (the working tree is never modified)")
        return 130
    print(summary(result) + f" ({time.perf_counter() - t0:.0f} s)")
    return 0 if not (result["survived"] or result["stale"] or result["errors"]) else 1


if __name__ == "__main__":
    sys.exit(main())
