"""Imports only go downward: base (errors, config, options, weights, ...) ← models ← experts ← decoding ← engine
← cli / serve / bench / integrations / eval. Every module's imports (module level and inside functions) are
read with `ast`; a module importing from a higher layer fails, and so does a module no layer claims."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "specmoe"

# lowest first; a module belongs to the longest prefix that names it
LAYERS: list[tuple[str, ...]] = [
    ("specmoe.errors", "specmoe.config", "specmoe.families", "specmoe.options", "specmoe.memory",
     "specmoe.tokenizer", "specmoe.bundled", "specmoe.weights"),
    ("specmoe.models",),
    ("specmoe.experts",),
    ("specmoe.decoding",),
    ("specmoe.engine",),
    ("specmoe.cli", "specmoe.serve", "specmoe.bench", "specmoe.integrations", "specmoe.eval", "specmoe.__main__",
     "specmoe"),
]


def layer_of(module: str) -> int | None:
    best, found = -1, None
    for i, names in enumerate(LAYERS):
        for name in names:
            if (module == name or module.startswith(name + ".")) and len(name) > best:
                best, found = len(name), i
    return found


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, imported specmoe module) for every import in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    me = module_name(path)
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
                is_mod = (ROOT.parent / Path(*sub.split("."))).with_suffix(".py").is_file() \
                    or (ROOT.parent / Path(*sub.split("."))).is_dir()
                out.append((node.lineno, sub if is_mod else target))
    return out


def upward_imports(root: Path = ROOT) -> list[str]:
    bad = []
    for path in sorted(root.rglob("*.py")):
        me = module_name(path)
        mine = layer_of(me)
        if mine is None:
            bad.append(f"{me}: no layer claims this module (add it to LAYERS in tests/test_layering.py)")
            continue
        for line, target in imports_of(path):
            theirs = layer_of(target)
            if theirs is not None and theirs > mine:
                bad.append(f"{path.relative_to(root.parent)}:{line}: {me} (layer {mine}) imports {target} (layer {theirs})")
    return bad


def test_imports_only_go_downward():
    bad = upward_imports()
    assert not bad, "upward imports:\n" + "\n".join(bad)


def test_the_check_finds_an_upward_import(tmp_path):
    """A planted upward import (models → engine, inside a function) is reported."""
    pkg = tmp_path / "specmoe"
    (pkg / "models").mkdir(parents=True)
    (pkg / "engine").mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "models" / "__init__.py").write_text("")
    (pkg / "engine" / "__init__.py").write_text("")
    (pkg / "engine" / "llm.py").write_text("from specmoe.models import decoder\n")
    (pkg / "models" / "decoder.py").write_text("def f():\n    from specmoe.engine.llm import LLM\n    return LLM\n")
    global ROOT
    saved, ROOT = ROOT, pkg
    try:
        bad = upward_imports(pkg)
    finally:
        ROOT = saved
    assert len(bad) == 1 and "specmoe.models.decoder (layer 1) imports specmoe.engine.llm (layer 4)" in bad[0], bad


@pytest.mark.parametrize("module,layer", [("specmoe.weights.checkpoint", 0), ("specmoe.models.moe", 1),
                                          ("specmoe.experts.cache", 2), ("specmoe.decoding.strategies.speculative", 3),
                                          ("specmoe.engine.llm", 4), ("specmoe.serve.app", 5)])
def test_layer_table(module, layer):
    assert layer_of(module) == layer
