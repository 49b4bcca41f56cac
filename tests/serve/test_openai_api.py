"""The OpenAI-compatible server against the official `openai` client: completions and chat, streaming and
not, 32 concurrent greedy streams equal to `LLM.generate`, bad requests, a disconnected stream, /metrics."""
from __future__ import annotations

import asyncio
import json

import pytest
import torch

from specmoe import LLM, SamplingParams
from specmoe.bundled import prompts_dir
from tests.serve.conftest import metric, need_server, scrape, start_server, wait_for

need_server()
httpx = pytest.importorskip("httpx")

KEY = "test-key"
MODEL = "specmoe-tiny-moe"
CTX = 256


@pytest.fixture(scope="module")
def server():
    s = start_server({"max_model_len": CTX, "max_batch": 48}, api_key=KEY)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def ref():
    """The oracle: LLM.generate on its own engine (same model, dtype and context)."""
    llm = LLM(dtype="float32", threads=1, max_model_len=CTX)
    yield llm
    llm.close()


def prompts(n: int) -> list[str]:
    out = []
    for domain in ("code", "docs", "bible", "fortunes"):
        lines = (prompts_dir() / f"{domain}.jsonl").read_text().splitlines()
        out += [json.loads(x)["prompt"][:100] for x in lines[: n // 4]]
    return out


def test_models_health_and_auth(server):
    assert [m.id for m in server.client().models.list().data] == [MODEL]
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, "prompt": "x"})  # no key
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("header", [f"Bearer wrong-{KEY}", f"Bearer {KEY[:-1]}", f"Bearer {KEY}x", "Bearer",
                                    f"Basic {KEY}", KEY, f"bearer {KEY}"])
def test_a_wrong_key_is_refused_over_the_socket(server, header):
    """Any Authorization header but `Bearer <the key>` is a 401, on every authenticated route; the right one
    passes (over a real connection to the running server)."""
    for method, path, body in (("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1}),
                               ("POST", "/v1/chat/completions",
                                {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
                               ("GET", "/v1/models", None)):
        r = httpx.request(method, server.url + path, json=body, headers={"Authorization": header}, timeout=30)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (header, path, r.text)
    ok = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert ok.status_code == 200


def test_the_openai_client_with_a_wrong_key_gets_an_authentication_error(server):
    import openai
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="not-" + KEY, max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="x", max_tokens=1)


def test_completion_stream_and_non_stream_equal_generate(server, ref):
    c = server.client()
    p = "def fibonacci(n):"
    want = ref.generate([p], SamplingParams(max_tokens=24, stop=["\n\n"]))[0]
    got = c.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0, stop=["\n\n"])
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == want.finish_reason
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.usage.completion_tokens == len(want.token_ids)
    chunks = list(c.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0, stop=["\n\n"],
                                       stream=True, stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == want.text
    assert len([ch for ch in chunks if ch.choices and ch.choices[0].text]) > 1  # streamed in pieces
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == want.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_chat_stream_and_non_stream_equal_generate_on_the_rendered_template(server, ref):
    from transformers import AutoTokenizer
    c = server.client()
    msgs = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "Sort a list."}]
    # the prompt transformers builds from the model's chat template (an oracle for our jinja2 rendering)
    ids = AutoTokenizer.from_pretrained(ref.path).apply_chat_template(msgs, add_generation_prompt=True)["input_ids"]
    want = ref.generate([ids], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    got = c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == ref.tokenizer.decode(want.token_ids)
    assert got.usage.prompt_tokens == len(ids) and got.usage.completion_tokens == 20
    chunks = list(c.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20, temperature=0, stream=True,
                                            extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == got.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_32_concurrent_greedy_streams_equal_generate(server, ref):
    """16 streams start, and 16 more join while those are still decoding (continuous batching): every
    streamed text equals LLM.generate of all 32 prompts in one batch."""
    ps = prompts(32)
    want = [o.text for o in ref.generate(ps, SamplingParams(max_tokens=24, ignore_eos=True))]
    steps0 = scrape(server.url)
    client = server.async_client()
    started = asyncio.Event()
    state = {"first_done_when_second_started": None}

    async def one(i: int) -> str:
        if i >= 16:
            await started.wait()
        text, n = "", 0
        stream = await client.completions.create(model=MODEL, prompt=ps[i], max_tokens=24, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        async for ch in stream:
            text += ch.choices[0].text
            n += 1
            if i == 0 and n == 3:  # the first wave is decoding: let the second wave in
                state["first_done_when_second_started"] = False
                started.set()
        return text

    async def run():
        return await asyncio.gather(*(one(i) for i in range(32)))
    got = asyncio.run(run())
    assert got == want
    assert state["first_done_when_second_started"] is False
    m = scrape(server.url)
    steps = metric(m, "specmoe_decode_steps_total") - metric(steps0, "specmoe_decode_steps_total")
    assert steps < 32 * 24 / 4  # sequences shared decode steps


def test_logprobs_match_the_scoring_path(server, ref):
    p = "The json module"
    r = server.client().completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0, logprobs=3,
                                           extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    ids = ref.tokenizer.encode(p)
    out = ref.generate([p], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids
    logits = ref.logits([ids + out])[0]  # [T, V]: scoring, an independent forward
    want = torch.log_softmax(logits[len(ids) - 1: len(ids) - 1 + len(out)], -1)
    assert len(lp.token_logprobs) == 6 and all(len(t) == 3 for t in lp.top_logprobs)
    for j, t in enumerate(out):
        assert lp.token_logprobs[j] == pytest.approx(want[j, t].item(), abs=1e-4)
        assert max(lp.top_logprobs[j].values()) == pytest.approx(want[j].max().item(), abs=1e-4)  # greedy: top-1


def test_n_choices_and_seeds(server):
    c = server.client()
    kw = dict(model=MODEL, prompt="And God said,", max_tokens=12, temperature=1.0, seed=7, n=3)
    a, b = c.completions.create(**kw), c.completions.create(**kw)
    assert [x.index for x in a.choices] == [0, 1, 2]
    assert [x.text for x in a.choices] == [x.text for x in b.choices]  # seeded: repeatable
    assert len({x.text for x in a.choices}) > 1  # choice j uses seed + j


BAD = [  # (endpoint, raw body, status, param named in the error)
    ("completions", "{not json", 400, None),
    ("completions", {"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("completions", {"model": MODEL, "prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ("completions", {"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ("completions", {"model": MODEL, "prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("completions", {"model": MODEL, "prompt": [1] * CTX}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": "x", "max_tokens": CTX}, 400, "max_tokens"),
    ("completions", {"model": MODEL, "prompt": [99999]}, 400, "prompt"),
    ("completions", {"model": MODEL}, 400, "prompt"),
    ("completions", {"model": MODEL, "prompt": "x", "n": 0}, 400, "n"),
    ("completions", {"model": MODEL, "prompt": "x", "stop": [""]}, 400, "stop"),
    ("completions", {"model": MODEL, "prompt": "x", "logprobs": 99}, 400, "logprobs"),
    ("completions", {"model": MODEL, "prompt": "x", "presence_penalty": 1.0}, 400, "presence_penalty"),
    ("chat/completions", {"model": MODEL, "messages": []}, 400, "messages"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "tool", "content": "x"}]}, 400, "messages"),
    ("chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
     400, "temperature"),
]


@pytest.mark.parametrize("endpoint,body,status,param", BAD, ids=[f"{b[0]}-{b[3]}-{i}" for i, b in enumerate(BAD)])
def test_bad_request_gets_an_openai_error_then_the_server_serves(server, endpoint, body, status, param):
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    raw = body if isinstance(body, str) else json.dumps(body)
    r = httpx.post(f"{server.url}/v1/{endpoint}", content=raw, headers=h, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["param"] == param
    if param is not None:
        assert param in err["message"]
    good = server.client().completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0)
    assert len(good.choices) == 1 and good.usage.completion_tokens >= 1


def test_openai_client_raises_its_own_error_types(server):
    import openai
    with pytest.raises(openai.NotFoundError):
        server.client().completions.create(model="nope", prompt="x")
    with pytest.raises(openai.BadRequestError, match="top_p"):
        server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], top_p=2)


def test_disconnected_stream_is_aborted_and_frees_its_slot(server):
    before = scrape(server.url)
    core = server.engine.core
    aborted0 = core.aborted
    h = {"Authorization": f"Bearer {KEY}"}
    body = {"model": MODEL, "prompt": "def f(x):", "max_tokens": CTX - 10, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", server.url + "/v1/completions", json=body, headers=h) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]  # a few tokens in: the request holds a KV slot
            assert any(x.startswith("data: {") for x in got)
            assert server.engine.running == 1
    # the client hung up mid-stream: the engine aborts the request at a step boundary and frees its slot
    wait_for(lambda: core.aborted == aborted0 + 1, what="the abort")
    wait_for(lambda: server.engine.running == 0 and core.num_free_slots == core.slot_cap, what="the slot back")
    assert len(core.free_slots) == core.n_slots
    after = scrape(server.url)
    assert metric(after, "specmoe_requests_finished_total", reason="aborted") == \
        metric(before, "specmoe_requests_finished_total", reason="aborted") + 1
    assert metric(after, "specmoe_kv_slots_free") == metric(after, "specmoe_kv_slots")
    generated = metric(after, "specmoe_generation_tokens_total") - metric(before, "specmoe_generation_tokens_total")
    assert generated < CTX - 10  # it did not run to completion


def test_metrics_parse_and_move(server):
    before = scrape(server.url)
    server.client().completions.create(model=MODEL, prompt="The json module", max_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    after = scrape(server.url)
    for name, least in [("specmoe_prompt_tokens_total", 3), ("specmoe_generation_tokens_total", 8),
                        ("specmoe_decode_steps_total", 7), ("specmoe_time_to_first_token_seconds_count", 1),
                        ("specmoe_inter_token_latency_seconds_count", 7),
                        ("specmoe_e2e_request_latency_seconds_count", 1)]:
        assert metric(after, name) - metric(before, name) >= least, name
    assert metric(after, "specmoe_requests_finished_total", reason="length") == \
        metric(before, "specmoe_requests_finished_total", reason="length") + 1
    assert metric(after, "specmoe_requests_running") == 0 and metric(after, "specmoe_requests_waiting") == 0
    for name in ("specmoe_expert_bytes_moved_total", "specmoe_expert_cache_hit_rate", "specmoe_tokens_per_step",
                 "specmoe_expert_fetch_wait_seconds_total"):
        assert (name, frozenset()) in after, name
    assert metric(after, "specmoe_tokens_per_step") == 1.0  # plain decoding: one token per step


def test_stream_withholds_a_partial_stop_string(server, ref):
    """A stop string that straddles a token boundary: after the first of those tokens the text ends with the
    stop's first character, which must not be streamed (the final text ends before the stop)."""
    p = "def fibonacci(n):"
    out = ref.generate([p], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    text, dec = out.text, ref.tokenizer.decode
    for k in range(1, len(out.token_ids)):
        b = len(dec(out.token_ids[:k]))
        stop = text[b - 1:b + 1]
        if b >= 2 and len(stop) == 2 and stop not in text[:b] and text.index(stop) == b - 1:
            break
    else:
        pytest.skip("no stop string straddles a token boundary in this output")
    want = ref.generate([p], SamplingParams(max_tokens=24, ignore_eos=True, stop=[stop]))[0]
    assert want.text == text[:b - 1]
    chunks = server.client().completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0, stream=True,
                                                stop=[stop], extra_body={"ignore_eos": True})
    assert "".join(ch.choices[0].text for ch in chunks) == want.text
