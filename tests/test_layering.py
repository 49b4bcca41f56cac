"""Imports only go downward, never sideways, and never in a circle.

Every module's imports (module level and inside functions) are read with `ast`. LAYERS lists the layers, lowest
first; a layer holds one or more units (packages or modules) that may import from the layers below and from
inside their own unit, never from another unit of their own layer (serve, bench and eval do not know each other)
nor from a layer above. A module no unit claims fails, and so does any import cycle between modules (a cycle
inside one unit, or inside one layer, is not an upward import, so it is looked for on its own).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "specmoe"
PACKAGE = "specmoe"  # specmoe/__init__.py, the public API (LLM, SamplingParams, ...): it claims only itself

# lowest first; a module belongs to the longest unit name that names it (itself or a package above it)
LAYERS: list[tuple[str, ...]] = [
    ("specmoe.errors",),
    ("specmoe.config", "specmoe.memory", "specmoe.bundled", "specmoe.machine_cache"),
    ("specmoe.kernels",),  # the native CPU kernels (C++ built on first use)
    ("specmoe.families", "specmoe.options", "specmoe.tokenizer"),
    ("specmoe.weights",),
    ("specmoe.models",),
    ("specmoe.experts",),
    ("specmoe.decoding",),
    ("specmoe.engine",),
    (PACKAGE,),
    ("specmoe.serve", "specmoe.bench", "specmoe.eval"),
    ("specmoe.integrations",),  # Ray Data / Ray Serve over the serve app; `specmoe batch`'s run
    ("specmoe.cli",),
    ("specmoe.__main__",),
    ("specmoe.dev",),  # developer tools (the mutation check): nothing imports them
]


def unit_of(module: str) -> tuple[int, str] | None:
    """(layer, unit) of a module, or None when no unit claims it."""
    best, found = -1, None
    for i, names in enumerate(LAYERS):
        for name in names:
            claims = module == name or (name != PACKAGE and module.startswith(name + "."))
            if claims and len(name) > best:
                best, found = len(name), (i, name)
    return found


def layer_of(module: str) -> int | None:
    u = unit_of(module)
    return u[0] if u else None


def module_name(path: Path, root: Path = ROOT) -> str:
    parts = path.relative_to(root.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, root: Path = ROOT) -> list[tuple[int, str]]:
    """(line, imported specmoe module) for every import in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    me = module_name(path, root)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.split(".")[0] == "specmoe"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against the package
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target.split(".")[0] != "specmoe":
                continue
            # `from specmoe.x import y` may name a submodule y: judge by the submodule when it is one
            for a in node.names:
                sub = f"{target}.{a.name}"
                is_mod = (root.parent / Path(*sub.split("."))).with_suffix(".py").is_file() \
                    or (root.parent / Path(*sub.split("."))).is_dir()
                out.append((node.lineno, sub if is_mod else target))
    return out


def bad_imports(root: Path = ROOT) -> list[str]:
    """Upward and sideways imports, and modules no unit claims."""
    bad = []
    for path in sorted(root.rglob("*.py")):
        me = module_name(path, root)
        mine = unit_of(me)
        if mine is None:
            bad.append(f"{me}: no layer claims this module (add it to LAYERS in tests/test_layering.py)")
            continue
        for line, target in imports_of(path, root):
            theirs = unit_of(target)
            if theirs is None:
                continue
            where = f"{path.relative_to(root.parent)}:{line}: {me} (layer {mine[0]})"
            if theirs[0] > mine[0]:
                bad.append(f"{where} imports {target} (layer {theirs[0]}): upward")
            elif theirs[0] == mine[0] and theirs[1] != mine[1]:
                bad.append(f"{where} imports {target} (layer {theirs[0]}, unit {theirs[1]}): sideways")
    return bad


def import_cycles(root: Path = ROOT) -> list[list[str]]:
    """Each set of modules that import one another in a circle (strongly connected components of the module
    graph with more than one module), as one cycle through them."""
    paths = {module_name(p, root): p for p in sorted(root.rglob("*.py"))}
    graph: dict[str, list[str]] = {}
    for me, path in paths.items():
        targets = []
        for _, t in imports_of(path, root):
            while t not in paths and "." in t:  # `from specmoe.x import name`: the module specmoe.x
                t = t.rpartition(".")[0]
            if t in paths and t != me and t not in targets:
                targets.append(t)
        graph[me] = targets
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    comps: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                comps.append(comp)

    for v in graph:
        if v not in index:
            visit(v)
    return [_cycle_through(sorted(c), graph) for c in comps]


def _cycle_through(comp: list[str], graph: dict[str, list[str]]) -> list[str]:
    """One cycle inside a strongly connected component, from its first module back to it."""
    inside, start = set(comp), comp[0]
    path, seen, v = [start], {start}, start
    while True:
        nxt = next(w for w in graph[v] if w in inside and (w == start or w not in seen))
        path.append(nxt)
        if nxt == start:
            return path
        seen.add(nxt)
        v = nxt


def test_imports_only_go_downward():
    bad = bad_imports()
    assert not bad, "upward or sideways imports:\n" + "\n".join(bad)


def test_no_import_cycle():
    cycles = import_cycles()
    assert not cycles, "import cycles:\n" + "\n".join(" -> ".join(c) for c in cycles)


def plant(tmp_path: Path, files: dict[str, str]) -> Path:
    """A specmoe tree of `files` (path -> source) under tmp_path, every package with its __init__.py."""
    pkg = tmp_path / "specmoe"
    for rel, src in {"__init__.py": "", **files}.items():
        p = pkg / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        for d in [p.parent, *p.parent.parents]:
            if d == pkg.parent:
                break
            (d / "__init__.py").touch()
        p.write_text(src)
    return pkg


@pytest.fixture
def planted(tmp_path):
    """Plant a tree; return its (bad imports, import cycles)."""
    def check(files: dict[str, str]) -> tuple[list[str], list[list[str]]]:
        pkg = plant(tmp_path, files)
        return bad_imports(pkg), import_cycles(pkg)
    return check


def test_the_check_finds_an_upward_import(planted):
    """A planted upward import (models → engine, inside a function) is reported."""
    bad, _ = planted({"engine/llm.py": "from specmoe.models import decoder\n",
                      "models/decoder.py": "def f():\n    from specmoe.engine.llm import LLM\n    return LLM\n"})
    assert len(bad) == 1 and "specmoe.models.decoder (layer 5) imports specmoe.engine.llm (layer 8): upward" in bad[0]


@pytest.mark.parametrize("src,dst,kind", [
    ("serve/app.py", "specmoe.cli.serve", "upward"),
    ("integrations/offline.py", "specmoe.cli.batch", "upward"),
    ("serve/app.py", "specmoe.integrations.ray_serve", "upward"),
    ("bench/runner.py", "specmoe.serve.app", "sideways"),
    ("serve/app.py", "specmoe.eval.perplexity", "sideways"),
    ("engine/llm.py", "specmoe", "upward"),
])
def test_the_check_finds_imports_between_the_top_units(planted, src, dst, kind):
    """cli, serve, bench, eval and integrations are units of their own: importing a higher one, or a sibling of the
    same layer, is reported."""
    mod = dst.rpartition(".")[2] if dst != PACKAGE else ""
    files = {src: f"from {dst.rpartition('.')[0]} import {mod}\n" if mod else "import specmoe\n"}
    if mod:
        files[dst.removeprefix("specmoe.").replace(".", "/") + ".py"] = ""
    bad, _ = planted(files)
    assert len(bad) == 1 and bad[0].endswith(kind), bad


def test_the_allowed_order_passes(planted):
    """The imports the real tree has between the top units: cli → integrations → serve; bench → the package."""
    bad, cycles = planted({"cli/batch.py": "def f():\n    from specmoe.integrations.offline import run\n",
                           "integrations/offline.py": "from specmoe.serve import app\n", "serve/app.py": "",
                           "bench/runner.py": "from specmoe import LLM\n"})
    assert bad == [] and cycles == []


def test_the_check_finds_an_import_cycle(planted):
    """Two modules of one unit importing each other (one of them inside a function, where the old
    config ↔ families cycle hid) and a three-module cycle are reported; neither is an upward import."""
    bad, cycles = planted({"experts/cache.py": "def f():\n    from specmoe.experts import loader\n",
                           "experts/loader.py": "from specmoe.experts.cache import ExpertCache\n",
                           "decoding/a.py": "from specmoe.decoding import b\n",
                           "decoding/b.py": "from specmoe.decoding.c import x\n",
                           "decoding/c.py": "import specmoe.decoding.a\n"})
    assert bad == [], bad
    assert sorted(" -> ".join(c) for c in cycles) == [
        "specmoe.decoding.a -> specmoe.decoding.b -> specmoe.decoding.c -> specmoe.decoding.a",
        "specmoe.experts.cache -> specmoe.experts.loader -> specmoe.experts.cache"], cycles


@pytest.mark.parametrize("module,layer", [("specmoe.kernels", 2), ("specmoe.weights.checkpoint", 4),
                                          ("specmoe.families.gpt_oss", 3), ("specmoe.models.moe", 5),
                                          ("specmoe.experts.cache", 6), ("specmoe.decoding.strategies.speculative", 7),
                                          ("specmoe.engine.llm", 8), ("specmoe", 9), ("specmoe.serve.app", 10),
                                          ("specmoe.bench.peers", 10), ("specmoe.integrations.offline", 11),
                                          ("specmoe.cli.batch", 12), ("specmoe.unclaimed", None)])
def test_layer_table(module, layer):
    assert layer_of(module) == layer
