#!/usr/bin/env python3
"""Build the license-clean, multi-domain corpus for the specmoe demo model.

Domains (all read from the local machine; nothing is downloaded):

* ``code``     Python standard-library source (*.py, incl. subpackages, excluding
               site-packages and test directories) of the interpreter running this
               script (``sysconfig.get_paths()["stdlib"]``) or of ``--python-src DIR``.
               The shipped model used Python 3.11.7's. License: PSF-2.0.
* ``docs``     The reStructuredText sources of the official Python 3.11 documentation
               shipped by Debian's ``python3.11-doc`` package
               (/usr/share/doc/python3.11/html/_sources/**/*.rst.txt). License: PSF-2.0
               (documentation). If the package is missing we fall back to pydoc-style
               docstrings of stdlib modules (see --docs-fallback).
* ``bible``    The King James Version, dumped with the ``bible`` program of Debian's
               ``bible-kjv`` + ``bible-kjv-text`` packages. Public domain.
               One document = one book chapter.
* ``fortunes`` Debian ``fortunes`` + ``fortunes-min`` (/usr/share/games/fortunes/*),
               split on ``%`` lines. One document = one fortune. Only the non-offensive
               collections are used (``fortunes-off`` is not read).

Each domain is split BY DOCUMENT into train / held-out with a seeded shuffle. Output:

    data/corpus/<domain>/train.jsonl   one {"id", "text"} per line
    data/corpus/<domain>/heldout.jsonl
    data/corpus/manifest.json          sizes, sources, licenses, seed

This script installs nothing; it tells you which apt packages are missing.

Usage:  .venv/bin/python scripts/build_corpus.py [--out data/corpus] [--seed 1234] [--python-src DIR]
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import random
import re
import shutil
import subprocess
import sys
import sysconfig

from specmoe.errors import InputError, SpecMoEError

DOCS_SRC = "/usr/share/doc/python3.11/html/_sources"
FORTUNE_DIR = "/usr/share/games/fortunes"

APT_HINT = {
    "docs": "python3.11-doc",
    "bible": "bible-kjv bible-kjv-text",
    "fortunes": "fortunes fortunes-min",
}

LICENSES = {
    "code": "PSF-2.0 (Python standard library source)",
    "docs": "PSF-2.0 (Python documentation, Debian python3.11-doc)",
    "bible": "Public domain (King James Version, Debian bible-kjv-text)",
    "fortunes": "Public domain / freely redistributable collections (Debian fortunes, fortunes-min; see /usr/share/doc/fortunes*/copyright)",
}


def find_stdlib(python_src: str | None) -> str:
    """The standard-library source folder: `python_src` if given, else the running interpreter's.
    It must hold the stdlib's .py files (os.py is the marker); InputError naming the folder if not."""
    root = python_src or sysconfig.get_paths()["stdlib"]
    how = "--python-src" if python_src else "the running interpreter's sysconfig stdlib path"
    if not os.path.isfile(os.path.join(root, "os.py")):
        raise InputError(f"Python standard-library sources not found at {root} (from {how}: no os.py there); "
                         "pass --python-src DIR, the folder that holds os.py")
    return root


def collect_code(root: str) -> list[tuple[str, str]]:
    docs = []
    skip_parts = {"site-packages", "test", "tests", "idle_test", "__pycache__"}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip_parts and not d.startswith("config-"))
        for fn in sorted(filenames):
            if not fn.endswith(".py"):
                continue
            p = os.path.join(dirpath, fn)
            try:
                with open(p, encoding="utf-8") as f:
                    text = f.read()
            except (UnicodeDecodeError, OSError):
                continue
            text = text.replace("\r\n", "\n").strip("\n")
            if len(text) < 64:
                continue
            docs.append((os.path.relpath(p, root), text + "\n"))
    return docs


def collect_docs(root: str) -> list[tuple[str, str]]:
    docs = []
    for p in sorted(glob.glob(os.path.join(root, "**", "*.rst.txt"), recursive=True)):
        rel = os.path.relpath(p, root)
        # changelog is a multi-MB list of issue numbers, not prose: skip it.
        if rel.startswith("whatsnew/changelog"):
            continue
        with open(p, encoding="utf-8", errors="replace") as f:
            text = f.read().replace("\r\n", "\n").strip("\n")
        if len(text) < 200:
            continue
        docs.append((rel, text + "\n"))
    return docs


def collect_docs_fallback() -> list[tuple[str, str]]:
    """pydoc text of stdlib modules (used only when python3.11-doc is missing)."""
    import importlib
    import pkgutil
    import pydoc

    docs = []
    names = sorted(m.name for m in pkgutil.iter_modules() if not m.name.startswith("_"))
    for name in names:
        if name in {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo"}:
            continue
        try:
            mod = importlib.import_module(name)
            if "site-packages" in (getattr(mod, "__file__", "") or ""):
                continue
            text = pydoc.plaintext.document(mod)
        except Exception:
            continue
        text = re.sub(r".\x08", "", text)
        if len(text) > 200:
            docs.append((name, text))
    return docs


def collect_bible() -> list[tuple[str, str]]:
    out = subprocess.run(
        ["bible", "-l10000", "gen1:1-rev22:21"], stdin=subprocess.DEVNULL,
        capture_output=True, text=True, check=True,
    ).stdout
    docs: list[tuple[str, str]] = []
    cur_title, cur_lines = None, []
    head_re = re.compile(r"^(\S.*\S) (\d+)$")
    verse_re = re.compile(r"^\s+(\d+) (.*)$")
    for line in out.splitlines():
        if not line.strip():
            continue
        m = head_re.match(line)
        if m and not line.startswith(" "):
            if cur_title is not None:
                docs.append((cur_title, cur_title + "\n\n" + "\n".join(cur_lines) + "\n"))
            cur_title, cur_lines = line.strip(), []
            continue
        v = verse_re.match(line)
        if v:
            cur_lines.append(f"{v.group(1)} {v.group(2).strip()}")
        elif cur_lines:  # continuation line (should not happen with -l10000)
            cur_lines[-1] += " " + line.strip()
    if cur_title is not None:
        docs.append((cur_title, cur_title + "\n\n" + "\n".join(cur_lines) + "\n"))
    return docs


def collect_fortunes(root: str) -> list[tuple[str, str]]:
    docs = []
    files = sorted(
        p for p in glob.glob(os.path.join(root, "*"))
        if os.path.isfile(p) and not p.endswith((".dat", ".u8")) and not os.path.islink(p)
    )
    seen = set()
    for p in files:
        with open(p, "rb") as f:
            raw = f.read().decode("utf-8", errors="replace")
        raw = re.sub(r".\x08", "", raw)  # strip overstriking (char + backspace)
        parts = re.split(r"(?m)^%\s*$", raw)
        for i, part in enumerate(parts):
            text = part.strip("\n")
            if len(text.strip()) < 8:
                continue
            h = hashlib.sha1(text.encode()).hexdigest()
            if h in seen:
                continue
            seen.add(h)
            docs.append((f"{os.path.basename(p)}#{i}", text + "\n"))
    return docs


def split(docs, frac, seed, domain, min_heldout):
    idx = list(range(len(docs)))
    rng = random.Random(f"{seed}-{domain}")
    rng.shuffle(idx)
    n_ho = max(min_heldout, int(round(frac * len(docs))))
    ho = set(idx[:n_ho])
    train = [docs[i] for i in range(len(docs)) if i not in ho]
    held = [docs[i] for i in range(len(docs)) if i in ho]
    return train, held


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="data/corpus")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--heldout-frac", type=float, default=0.06)
    ap.add_argument("--docs-fallback", action="store_true",
                    help="use pydoc docstrings instead of the python3.11-doc package")
    ap.add_argument("--python-src", default=None, metavar="DIR",
                    help="Python standard-library source folder for the code domain (the one holding os.py; "
                         "default: the running interpreter's, sysconfig.get_paths()['stdlib'])")
    args = ap.parse_args()
    try:
        py_stdlib = find_stdlib(args.python_src)
    except SpecMoEError as e:
        sys.exit(f"build_corpus.py: error: {e}")

    missing = []
    if not args.docs_fallback and not os.path.isdir(DOCS_SRC):
        missing.append(("docs", APT_HINT["docs"]))
    if shutil.which("bible") is None or not os.path.exists("/usr/lib/bible.data"):
        missing.append(("bible", APT_HINT["bible"]))
    if not os.path.isdir(FORTUNE_DIR):
        missing.append(("fortunes", APT_HINT["fortunes"]))
    if missing:
        pk = " ".join(p for _, p in missing)
        sys.exit(f"Missing sources for {[d for d, _ in missing]}. Install with:\n"
                 f"  apt-get update && apt-get install -y {pk}\n"
                 f"(or pass --docs-fallback to use pydoc text for the docs domain)")

    collectors = {
        "code": (lambda: collect_code(py_stdlib), py_stdlib),
        "docs": ((collect_docs_fallback, "pydoc of stdlib modules") if args.docs_fallback
                 else (lambda: collect_docs(DOCS_SRC), DOCS_SRC)),
        "bible": (collect_bible, "bible -l10000 gen1:1-rev22:21 (/usr/lib/bible.data)"),
        "fortunes": (lambda: collect_fortunes(FORTUNE_DIR), FORTUNE_DIR),
    }
    if os.path.isdir(args.out):
        shutil.rmtree(args.out)
    manifest = {"seed": args.seed, "heldout_frac": args.heldout_frac, "domains": {}}
    total = 0
    print(f"{'domain':10s} {'docs':>7s} {'train_docs':>10s} {'ho_docs':>8s} {'train_MB':>9s} {'ho_MB':>7s}")
    for domain, (fn, src) in collectors.items():
        docs = fn()
        train, held = split(docs, args.heldout_frac, args.seed, domain, min_heldout=40)
        d = os.path.join(args.out, domain)
        os.makedirs(d, exist_ok=True)
        info = {"source": src, "license": LICENSES[domain] if not (domain == "docs" and args.docs_fallback)
                else "PSF-2.0 (stdlib docstrings)"}
        for name, part in (("train", train), ("heldout", held)):
            with open(os.path.join(d, f"{name}.jsonl"), "w", encoding="utf-8") as f:
                for doc_id, text in part:
                    f.write(json.dumps({"id": doc_id, "text": text}, ensure_ascii=False) + "\n")
            nbytes = sum(len(t.encode("utf-8")) for _, t in part)
            info[f"{name}_docs"] = len(part)
            info[f"{name}_bytes"] = nbytes
            total += nbytes
        manifest["domains"][domain] = info
        print(f"{domain:10s} {len(docs):7d} {len(train):10d} {len(held):8d} "
              f"{info['train_bytes']/1e6:9.2f} {info['heldout_bytes']/1e6:7.2f}")
    manifest["total_bytes"] = total
    with open(os.path.join(args.out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    print(f"total {total/1e6:.2f} MB -> {args.out}")


if __name__ == "__main__":
    main()
