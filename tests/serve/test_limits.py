"""Admission control and failure handling: a full waiting queue answers 429 with Retry-After, a request past
its timeout is aborted (504) and frees its slot, a failed engine step answers 500 and the next request is
served by a fresh engine core."""
from __future__ import annotations

import time

import pytest

from tests.serve.conftest import metric, need_server, scrape, start_server, wait_for

need_server()
httpx = pytest.importorskip("httpx")

MODEL = "specmoe-tiny-moe"
LONG = {"model": MODEL, "prompt": "def f(x):", "max_tokens": 200, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def one_slot():
    s = start_server({"max_model_len": 256, "max_batch": 1}, max_waiting=1)
    yield s
    s.stop()


def test_full_queue_answers_429_with_retry_after(one_slot):
    s = one_slot
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", s.url + "/v1/completions", json={**LONG, "stream": True}) as first:
            lines = first.iter_lines()  # held: a dropped iterator closes the connection, which aborts the request
            next(lines)  # running: it holds the only slot
            with http.stream("POST", s.url + "/v1/completions", json={**LONG, "stream": True}) as second:
                assert second.status_code == 200  # queued: it waits for the slot
                r = http.post(s.url + "/v1/completions", json=LONG)
                assert r.status_code == 429, r.text
                assert r.headers["Retry-After"] == "1"
                assert r.json()["error"]["code"] == "queue_full"
    wait_for(lambda: s.engine.running == 0 and s.engine.waiting == 0, what="both streams aborted")
    assert metric(scrape(s.url), "specmoe_requests_rejected_total", status="429") == 1
    ok = s.client().completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=0)
    assert ok.choices[0].finish_reason in ("stop", "length")


def test_a_request_in_the_core_counts_as_waiting_while_a_step_runs(one_slot):
    """The bound holds during a step: a request the loop has moved from its inbox into the core counts as waiting
    at once, not only once the step after it ends (a request arriving in between used to get in)."""
    s = one_slot
    core = s.engine.core
    step = core.strategy.step
    core.strategy.step = lambda seqs: (time.sleep(0.3), step(seqs))[1]  # steps long enough to arrive in
    try:
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", s.url + "/v1/completions", json={**LONG, "stream": True}) as first:
                lines = first.iter_lines()  # held (see above)
                next(lines)  # running: it holds the only slot
                with http.stream("POST", s.url + "/v1/completions", json={**LONG, "stream": True}) as second:
                    assert second.status_code == 200
                    wait_for(lambda: len(core.waiting) == 1, what="the second request in the core")
                    r = http.post(s.url + "/v1/completions", json=LONG, timeout=5)
                    assert r.status_code == 429, r.text
    finally:
        core.strategy.step = step
    wait_for(lambda: s.engine.running == 0 and s.engine.waiting == 0, what="both streams aborted")


def test_failed_step_answers_500_and_a_fresh_core_serves_the_next(one_slot):
    s = one_slot
    core = s.engine.core

    def broken(seqs):
        raise RuntimeError("injected step failure")
    core.strategy.step = broken
    r = httpx.post(s.url + "/v1/completions", json={**LONG, "max_tokens": 5}, timeout=30)
    assert r.status_code == 500 and "injected step failure" in r.json()["error"]["message"]
    wait_for(lambda: s.engine.core is not None and s.engine.core is not core, what="a fresh core")
    assert s.engine.failed_steps == 1
    ok = s.client().completions.create(model=MODEL, prompt="x", max_tokens=3, temperature=0)
    assert ok.usage.completion_tokens >= 1
    assert metric(scrape(s.url), "specmoe_requests_finished_total", reason="error") == 1


def test_request_past_its_timeout_is_aborted_with_504():
    s = start_server({"max_model_len": 1024}, request_timeout_s=0.3)
    try:
        body = {**LONG, "max_tokens": 1000}
        r = httpx.post(s.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 504 and r.json()["error"]["code"] == "timeout", r.text
        core = s.engine.core
        wait_for(lambda: core.num_free_slots == core.slot_cap, what="the slot back")
        assert core.aborted == 1
        # streaming: an error event, then [DONE]
        with httpx.Client(timeout=30) as http:
            with http.stream("POST", s.url + "/v1/completions", json={**body, "stream": True}) as st:
                lines = [x for x in st.iter_lines() if x]
        assert lines[-1] == "data: [DONE]" and '"timeout"' in lines[-2]
        assert metric(scrape(s.url), "specmoe_requests_finished_total", reason="timeout") == 2
    finally:
        s.stop()
