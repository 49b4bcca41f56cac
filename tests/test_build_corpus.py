"""scripts/build_corpus.py finds the Python standard-library sources through the running
interpreter or --python-src, and says clearly when they are not there."""
import importlib.util
import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from specmoe.errors import SpecMoEError

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "build_corpus.py"


def load_script():
    spec = importlib.util.spec_from_file_location("build_corpus", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_stdlib_comes_from_the_running_interpreter():
    bc = load_script()
    root = bc.find_stdlib(None)
    assert root == sysconfig.get_paths()["stdlib"] and os.path.isfile(os.path.join(root, "os.py"))
    docs = dict(bc.collect_code(root))
    assert "os.py" in docs and "json/decoder.py" in docs and not any("site-packages" in p for p in docs)


def test_python_src_flag_is_used_and_checked(tmp_path):
    bc = load_script()
    (tmp_path / "os.py").write_text("# a stand-in standard library\n" * 4)
    assert bc.find_stdlib(str(tmp_path)) == str(tmp_path)
    with pytest.raises(SpecMoEError) as e:
        bc.find_stdlib(str(tmp_path / "nope"))
    assert "\n" not in str(e.value) and str(tmp_path / "nope") in str(e.value) and "--python-src" in str(e.value)


def test_missing_stdlib_is_a_one_line_exit(tmp_path):
    p = subprocess.run([sys.executable, SCRIPT, "--python-src", tmp_path / "nope", "--out", tmp_path / "corpus"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and p.stderr.strip().count("\n") == 0, p.stderr
    assert str(tmp_path / "nope") in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "corpus").exists()
