"""The installable package: a real sdist and wheel built from this tree (as `python -m build` does:
sdist first, wheel from the unpacked sdist), installed into a fresh venv and run from a folder
outside the repository. The installed `LLM()` and `specmoe generate` must find the bundled demo
model inside the installed package, not in a checkout.

Offline: the fresh venv gets only the wheel (no dependencies, no index); torch and the other
dependencies come from this interpreter's site-packages through a .pth file written after the
install. A .pth-added folder's own .pth files are not processed, so this environment's editable
specmoe (if any) stays invisible; the test asserts that `specmoe` is imported from the fresh venv.
"""
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from specmoe.errors import SpecMoEError

REPO = Path(__file__).resolve().parents[1]
# build outputs and local state that a clean clone does not have
IGNORE = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                                ".specmoe", ".specmoe-cache", "data", "bench-results")
PROMPT = "def add(a, b):"


def run(cmd, cwd, env=None, timeout=600) -> subprocess.CompletedProcess:
    p = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, f"{cmd} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}"
    return p


def sh(cmd, cwd, env=None, timeout=600) -> str:
    return run(cmd, cwd, env, timeout).stdout


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv dir, its python, env for it, a work folder outside the repo) with the built wheel installed."""
    tmp = tmp_path_factory.mktemp("pkg")
    src, dist = tmp / "src", tmp / "dist"
    shutil.copytree(REPO, src, ignore=IGNORE)
    # what `make demo` (disk offload) leaves in a checkout: a local repack, which must stay out of the wheel
    stray = src / "models" / "specmoe-tiny-moe" / ".specmoe"
    stray.mkdir()
    (stray / "manifest.json").write_text("{}")
    dist.mkdir()
    built = run([sys.executable, "-c", "import sys; from setuptools import build_meta as b; "
                 "print(b.build_sdist(sys.argv[1]))", dist], cwd=src)
    name = built.stdout.strip().splitlines()[-1]
    with tarfile.open(dist / name) as tar:
        tar.extractall(tmp / "sdist", **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    (sdist,) = (tmp / "sdist").iterdir()
    sh([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q",
        "-w", dist, sdist], cwd=tmp)
    (wheel,) = dist.glob("specmoe-*.whl")

    venv = tmp / "venv"
    sh([sys.executable, "-m", "venv", "--without-pip", venv], cwd=tmp)
    py = venv / "bin" / "python"
    sh([sys.executable, "-m", "pip", "--python", py, "install", "--no-deps", "--no-index", "-q", wheel], cwd=tmp)
    # only now (pip would otherwise see this environment's specmoe as already installed): borrow
    # torch & co. from the running interpreter's import path, as a fresh process sees it, minus this checkout
    purelib = Path(sh([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], cwd=tmp).strip())
    seen = sh([sys.executable, "-c", "import sys; print('\\n'.join(sys.path))"], cwd=tmp).splitlines()
    borrowed = [p for p in seen if p and Path(p).is_dir() and not Path(p).resolve().is_relative_to(REPO)]
    (purelib / "_borrowed_deps.pth").write_text("".join(f"{p}\n" for p in borrowed))

    work = tmp / "elsewhere"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS="1", HOME=str(tmp / "home"), PYTHONDONTWRITEBYTECODE="1")
    return {"venv": venv.resolve(), "py": py, "env": env, "work": work, "wheel": wheel, "sdist": dist / name,
            "build_log": built.stderr}


def test_wheel_carries_the_demo_model_and_prompts(installed):
    import zipfile
    names = set(zipfile.ZipFile(installed["wheel"]).namelist())
    for f in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "expert_profile.json",
              "README.md"):
        assert f"specmoe/demo_model/{f}" in names
    for d in ("code", "docs", "bible", "fortunes"):
        assert f"specmoe/demo_prompts/{d}.jsonl" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert not any("/.specmoe/" in n for n in names)  # never a local repack
    # the sdist the wheel was built from carries the model too (PyPI users build from it)
    with tarfile.open(installed["sdist"]) as tar:
        assert any(n.endswith("models/specmoe-tiny-moe/model.safetensors") for n in tar.getnames())
    # pyproject.toml uses current metadata (SPDX license string, license-files): no deprecation
    assert "SetuptoolsDeprecationWarning" not in installed["build_log"], installed["build_log"][-2000:]


def test_installed_llm_runs_the_bundled_model_from_outside_the_repo(installed):
    from specmoe import LLM, SamplingParams
    code = ("import json, specmoe; from specmoe import LLM, SamplingParams; from specmoe.bundled import prompts_dir\n"
            "llm = LLM(threads=1)\n"
            f"o = llm.generate([{PROMPT!r}], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]\n"
            "print(json.dumps({'file': specmoe.__file__, 'model': str(llm.path), 'prompts': str(prompts_dir()),"
            " 'ids': o.token_ids, 'text': o.text}))")
    out = json.loads(sh([installed["py"], "-c", code], cwd=installed["work"], env=installed["env"]).splitlines()[-1])
    venv = installed["venv"]
    assert Path(out["file"]).resolve().is_relative_to(venv), out["file"]  # the wheel's specmoe, not the checkout
    model = Path(out["model"]).resolve()
    assert model.is_relative_to(venv) and model.name == "demo_model"
    assert Path(out["prompts"]).resolve().is_relative_to(venv)
    assert sha256(model / "model.safetensors") == sha256(REPO / "models" / "specmoe-tiny-moe" / "model.safetensors")
    # the same model: the installed copy continues the prompt exactly as the checkout does
    ref = LLM(threads=1).generate([PROMPT], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert out["ids"] == ref.token_ids and len(ref.token_ids) == 8 and out["text"] == ref.text


def test_installed_cli_generates_with_the_bundled_model(installed):
    script = installed["venv"] / "bin" / "specmoe"  # the console script pip wrote from [project.scripts]
    out = json.loads(sh([script, "generate", "--prompt", PROMPT, "--max-tokens", "8", "--threads", "1", "--json"],
                        cwd=installed["work"], env=installed["env"]))
    assert Path(out["model"]).resolve().is_relative_to(installed["venv"])
    assert len(out["outputs"]) == 1 and 0 < len(out["outputs"][0]["token_ids"]) <= 8


def test_every_code_package_is_in_the_wheel_list():
    tomllib = pytest.importorskip("tomllib")
    listed = set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    on_disk = {".".join(p.parent.relative_to(REPO).parts) for p in (REPO / "specmoe").rglob("__init__.py")}
    assert on_disk <= listed, f"add to [tool.setuptools] packages in pyproject.toml: {sorted(on_disk - listed)}"


def test_missing_demo_model_is_a_one_line_error(tmp_path, monkeypatch):
    from specmoe import bundled
    gone = (tmp_path / "a", tmp_path / "b")
    monkeypatch.setattr(bundled, "DEMO_MODEL_CANDIDATES", gone)
    with pytest.raises(SpecMoEError) as e:
        bundled.demo_model_dir()
    msg = str(e.value)
    assert "\n" not in msg and str(gone[0]) in msg and str(gone[1]) in msg and "--model" in msg
    assert bundled.demo_model_dir(check=False) == gone[1]


def make_dry_run(tmp_path, *overrides) -> list[str]:
    """The commands `make setup` would run for a .venv that does not exist yet."""
    if shutil.which("make") is None:
        pytest.fail("make is not installed (the README's set-up commands need it)")
    out = sh(["make", "-n", "-C", REPO, "setup", f"VENV={tmp_path / 'venv'}", *overrides], cwd=tmp_path)
    return [line for line in out.splitlines() if " install " in line]


def test_make_setup_installs_torch_as_told(tmp_path):
    torch_line, deps_line = [line for line in make_dry_run(tmp_path) if "--upgrade pip" not in line]
    assert torch_line.endswith('install -q "torch==2.13.0"')  # the default: no index given
    cuda = "https://download.pytorch.org/whl/cu128"
    torch_line, deps_line = [line for line in make_dry_run(tmp_path, "TORCH=torch==2.13.0+cu128", f"TORCH_INDEX={cuda}")
                             if "--upgrade pip" not in line]
    assert '"torch==2.13.0+cu128"' in torch_line and f'--index-url "{cuda}"' in torch_line
    assert "-e" in deps_line and "index-url" not in deps_line  # the other dependencies come from pip's index
