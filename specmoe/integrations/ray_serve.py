"""Ray Serve: N replicas of the OpenAI-compatible app (`specmoe.serve.app.build_app(llm, config)`) behind
one HTTP route.

Each replica is one Ray actor that builds its own `LLM` (its own expert cache, KV cache and engine loop)
and its own app from it; Ray Serve's proxy sends each HTTP request to one replica, so a request's tokens
come from one engine. Replicas share only the read-only checkpoint and the disk tier's repack, which
`deploy` builds once before any replica starts.

    from specmoe.integrations.ray_serve import deploy
    deploy(llm={"offload": "disk", "cache_experts": 8}, config={"model_name": "tiny"}, num_replicas=2,
           port=8000)   # POST http://127.0.0.1:8000/v1/completions, answered by either replica
"""
from __future__ import annotations

import os
import socket

from specmoe.integrations import require

REPLICA_HEADER = "x-specmoe-replica"  # host:pid of the replica that answered


def tag_responses(app, value: str):
    """The ASGI app with a REPLICA_HEADER on every HTTP response (lifespan and other scopes pass through)."""
    header = (REPLICA_HEADER.encode(), value.encode())

    async def tagged(scope, receive, send):
        if scope["type"] != "http":
            return await app(scope, receive, send)

        async def send_tagged(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), header]}
            await send(message)
        return await app(scope, receive, send_tagged)
    return tagged


class SpecMoEReplica:
    """One replica: `LLM(**llm)` and `build_app(llm, ServeConfig(**config))`, the app built after the
    constructor (Ray Serve's deferred ingress, `__serve_build_asgi_app__`); responses name the replica."""

    def __init__(self, llm: dict | None = None, config: dict | None = None):
        from specmoe.engine.llm import LLM
        from specmoe.serve.config import ServeConfig
        self.config = ServeConfig(**(config or {}))
        self.llm = LLM(**(llm or {}))
        self.name = f"{socket.gethostname()}:{os.getpid()}"

    def __serve_build_asgi_app__(self):
        from specmoe.serve.app import build_app
        return tag_responses(build_app(self.llm, self.config), self.name)


def application(llm: dict | None = None, config: dict | None = None, *, num_replicas: int = 1,
                cpus_per_replica: float = 1, gpus_per_replica: float = 0, name: str = "specmoe"):
    """The bound Ray Serve application (for `serve.run`): `num_replicas` SpecMoEReplica deployments."""
    serve = require("ray.serve", "ray", "Ray Serve replicas")
    require("specmoe.serve.app", "serve", "Ray Serve replicas of the OpenAI-compatible app")
    from specmoe.options import check_int
    check_int("num_replicas", num_replicas, 1)
    llm = dict(llm or {})
    if llm.get("threads") is None:  # torch threads = the CPUs Ray reserves for the replica
        llm["threads"] = max(1, int(cpus_per_replica))
    options = {"num_cpus": cpus_per_replica, **({"num_gpus": gpus_per_replica} if gpus_per_replica else {})}
    dep = serve.deployment(serve.ingress()(SpecMoEReplica), name=name, num_replicas=num_replicas,
                           ray_actor_options=options)
    return dep.bind(llm, dict(config or {}))


def deploy(llm: dict | None = None, config: dict | None = None, *, num_replicas: int = 1,
           cpus_per_replica: float = 1, gpus_per_replica: float = 0, host: str = "127.0.0.1", port: int = 8000,
           ray_address: str | None = None, route_prefix: str = "/"):
    """Connect to Ray (`ray_address`, or a local instance), build the shared repack once, start Serve's HTTP
    proxy on host:port and run the application under `route_prefix`. Returns its handle; `serve.shutdown()`
    stops it."""
    from specmoe.integrations import ray as rx
    serve = require("ray.serve", "ray", "Ray Serve replicas")
    app = application(llm, config, num_replicas=num_replicas, cpus_per_replica=cpus_per_replica,
                      gpus_per_replica=gpus_per_replica)
    rx.connect(ray_address)
    rx.prepare(dict(llm or {}))
    serve.start(http_options={"host": host, "port": port})
    return serve.run(app, name="specmoe", route_prefix=route_prefix)
