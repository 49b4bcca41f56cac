"""Ray Serve: two replicas of the OpenAI-compatible app behind one route, on the local Ray instance with 2
CPUs (conftest's). Concurrent completions are answered by both replicas and equal `LLM.generate` (greedy, fp32)."""
from __future__ import annotations

import json
import socket
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

pytest.importorskip("ray.serve")
pytest.importorskip("specmoe.serve.app", reason="specmoe.serve (the OpenAI-compatible app) is not in this tree")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(port: int, prompt: str) -> tuple[dict, str]:
    """(the completion, the replica that answered)."""
    from specmoe.integrations.ray_serve import REPLICA_HEADER
    body = {"model": "specmoe-tiny-moe", "prompt": prompt, "max_tokens": 6, "temperature": 0}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read()), r.headers[REPLICA_HEADER]


def test_two_replicas_behind_one_route(one_thread, local_ray):
    from ray import serve

    from specmoe import LLM, SamplingParams
    from specmoe.integrations.ray_serve import deploy
    port = free_port()
    try:
        deploy(llm={"dtype": "float32"}, num_replicas=2, cpus_per_replica=0.5, port=port)
        states = {name: d.replica_states for a in serve.status().applications.values()
                  for name, d in a.deployments.items()}
        assert states == {"specmoe": {"RUNNING": 2}}
        prompts = [f"def f{i}(x):" for i in range(12)]
        with ThreadPoolExecutor(len(prompts)) as ex:
            outs = list(ex.map(lambda p: post(port, p), prompts))
        with LLM(dtype="float32") as llm:
            want = llm.generate(prompts, SamplingParams(max_tokens=6))
        assert [o["choices"][0]["text"] for o, _ in outs] == [w.text for w in want]
        # more requests at once than one replica takes (Serve's max_ongoing_requests, 5): both engines answered
        assert len({replica for _, replica in outs}) == 2
    finally:
        serve.shutdown()
