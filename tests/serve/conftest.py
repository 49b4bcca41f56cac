"""A real server for the serve tests: uvicorn in a thread on a free loopback port, one per module, with the
uvicorn settings `specmoe serve` uses (specmoe.serve.http.uvicorn_config).

Nothing optional is imported here: a module that starts a server calls `need_server()` first, so it skips when
the [serve] extra or the dev clients are missing, while the tests that need neither (the install hint) still
run on a machine without them."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import pytest

# what a live server and its clients need: the [serve] extra, and the dev clients (openai, httpx)
SERVER = ("fastapi", "uvicorn", "starlette", "prometheus_client", "jinja2", "openai", "httpx")


def need_server() -> None:
    """Skip the calling test module (called at its top) or test when a package in SERVER is missing."""
    for name in SERVER:
        pytest.importorskip(name)


@dataclass
class Server:
    url: str  # http://127.0.0.1:PORT
    app: object
    llm: object
    uvicorn: object
    thread: threading.Thread
    torch_threads: int

    @property
    def engine(self):
        return self.app.state.engine

    def client(self, **kw):
        import openai
        cfg = self.app.state.config
        return openai.OpenAI(base_url=self.url + "/v1", api_key=cfg.api_key or "none", max_retries=0, **kw)

    def async_client(self, **kw):
        import openai
        cfg = self.app.state.config
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=cfg.api_key or "none", max_retries=0, **kw)

    def stop(self):
        self.uvicorn.should_exit = True
        self.thread.join(30)
        self.llm.close()
        import torch
        torch.set_num_threads(self.torch_threads)  # LLM(threads=1) set it process-wide


def start_server(llm_kwargs: dict | None = None, **config) -> Server:
    """An LLM on the demo model (fp32, one thread) behind build_app, served by uvicorn on port 0."""
    import torch
    import uvicorn

    from specmoe import LLM
    threads = torch.get_num_threads()
    from specmoe.serve.app import build_app
    from specmoe.serve.config import ServeConfig
    from specmoe.serve.http import uvicorn_config
    llm = LLM(**{"dtype": "float32", "threads": 1, **(llm_kwargs or {})})
    cfg = ServeConfig(port=0, **config)
    app = build_app(llm, cfg)
    srv = uvicorn.Server(uvicorn_config(app, cfg, log_level="warning", lifespan="on"))  # as `specmoe serve`
    th = threading.Thread(target=srv.run, name="uvicorn", daemon=True)
    th.start()
    t0 = time.monotonic()
    while not srv.started:
        assert th.is_alive() and time.monotonic() - t0 < 60, "the server did not start"
        time.sleep(0.02)
    port = srv.servers[0].sockets[0].getsockname()[1]
    return Server(f"http://127.0.0.1:{port}", app, llm, srv, th, threads)


def scrape(url: str) -> dict:
    """/metrics parsed with prometheus_client's own parser: {(sample name, frozen labels): value}."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families
    r = httpx.get(url + "/metrics", timeout=10)
    assert r.status_code == 200
    out = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def metric(m: dict, name: str, **labels) -> float:
    return m.get((name, frozenset(labels.items())), 0.0)


def wait_for(cond, timeout: float = 20.0, what: str = "condition"):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, f"timed out waiting for {what}"
        time.sleep(0.02)
