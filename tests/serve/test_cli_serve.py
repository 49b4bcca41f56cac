"""`specmoe serve` from the command line: the core package never imports the server stack, a missing
extra is one clear line, and the real command serves requests until it is interrupted."""
from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.serve.conftest import need_server

REPO = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
SERVER_STACK = ("fastapi", "uvicorn", "starlette", "prometheus_client", "jinja2")


def py(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=ENV, cwd=REPO,
                          timeout=120)


def test_core_package_does_not_import_the_server_stack():
    r = py("import sys, specmoe, specmoe.serve, specmoe.serve.config, specmoe.cli\n"
           "specmoe.cli.build_parser()\n"
           f"print([m for m in {SERVER_STACK!r} if m in sys.modules])")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_serve_without_the_extra_prints_an_install_hint():
    r = py("import sys\nsys.modules['fastapi'] = None  # as if the [serve] extra were not installed\n"
           "from specmoe.cli import main\nsys.exit(main(['serve']))")
    # fastapi, and whichever of the rest of the extra this environment lacks as well
    missing = ["fastapi"] + [m for m in ("uvicorn", "prometheus_client", "jinja2")
                             if importlib.util.find_spec(m) is None]
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [
        f"specmoe: error: specmoe serve needs the serve extra (missing: {', '.join(missing)}); install it with "
        "pip install 'specmoe[serve]'"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_serve_help_documents_every_server_flag(capsys):
    from specmoe.cli import build_parser
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    for flag in ("--host", "--port", "--api-key", "--served-model-name", "--max-waiting", "--request-timeout",
                 "--max-body-size", "--header-timeout", "--body-timeout", "--keep-alive-timeout"):
        assert f"{flag} " in text.split("options:")[1], flag
    assert "SPECMOE_API_KEY" in text and "413" in text and "408" in text


def test_specmoe_serve_command_serves_until_interrupted():
    """The real command, its key from SPECMOE_API_KEY (as vLLM's VLLM_API_KEY)."""
    need_server()
    import httpx
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "specmoe", "serve", "--port", str(port), "--threads", "1",
                          "--max-model-len", "128", "--served-model-name", "demo", "--log-level", "warning",
                          "--max-body-size", "1KiB"],
                         env={**ENV, "SPECMOE_API_KEY": "env-key"}, cwd=REPO, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}"
        t0 = time.monotonic()
        while True:
            assert p.poll() is None, p.stderr.read()
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() - t0 < 90, "specmoe serve did not come up"
            time.sleep(0.2)
        body = {"model": "demo", "prompt": "And God said,", "max_tokens": 4, "temperature": 0}
        r = httpx.post(url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        key = {"Authorization": "Bearer env-key"}
        r = httpx.post(url + "/v1/completions", json=body, headers=key, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == "demo" and r.json()["usage"]["completion_tokens"] >= 1
        assert json.loads(httpx.get(url + "/v1/models", headers=key).text)["data"][0]["max_model_len"] == 128
        r = httpx.post(url + "/v1/completions", json={**body, "prompt": "x" * 2000}, headers=key, timeout=30)
        assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"  # --max-body-size
    finally:
        p.send_signal(signal.SIGINT)
        try:
            p.wait(30)
        finally:
            if p.poll() is None:
                p.kill()
    assert p.returncode == 0, p.stderr.read()
