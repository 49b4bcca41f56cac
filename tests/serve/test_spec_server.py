"""A SpecMoE server (experts offloaded to host RAM): concurrent greedy streams joining and leaving the batch
equal plain greedy LLM.generate (fp32), and /metrics shows the speculation and the expert traffic."""
from __future__ import annotations

import asyncio

import pytest

from specmoe import LLM, SamplingParams
from tests.serve.conftest import metric, need_server, scrape, start_server
from tests.serve.test_openai_api import MODEL, prompts

need_server()


@pytest.fixture(scope="module")
def spec_server():
    s = start_server({"max_model_len": 256, "decoding": "specmoe", "draft_experts": 4, "num_draft_tokens": 4,
                      "offload": "host", "cache_experts": 8})
    yield s
    s.stop()


def test_concurrent_specmoe_streams_equal_plain_greedy(spec_server):
    ps = prompts(12)
    lengths = [8 + 4 * (i % 4) for i in range(12)]  # requests finish at different steps, others keep going
    ref = LLM(dtype="float32", threads=1, max_model_len=256)
    want = [o.text for o in ref.generate(ps, [SamplingParams(max_tokens=n, ignore_eos=True) for n in lengths])]
    ref.close()
    before = scrape(spec_server.url)
    client = spec_server.async_client()

    async def one(i):
        await asyncio.sleep(0.05 * i)  # staggered arrivals: requests join between steps
        stream = await client.completions.create(model=MODEL, prompt=ps[i], max_tokens=lengths[i], temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True})
        return "".join([ch.choices[0].text async for ch in stream])

    async def run():
        return await asyncio.gather(*(one(i) for i in range(12)))
    assert asyncio.run(run()) == want
    after = scrape(spec_server.url)
    assert metric(after, "specmoe_tokens_per_step") > 1.0  # drafts were accepted
    assert metric(after, "specmoe_drafter_rows_total", drafter="self") > 0  # which drafter drafted, by label
    assert metric(after, "specmoe_drafter_tokens_per_step", drafter="self") > 1.0
    assert metric(after, "specmoe_expert_bytes_moved_total") > metric(before, "specmoe_expert_bytes_moved_total")
    assert 0 < metric(after, "specmoe_expert_cache_hit_rate") < 1
    assert metric(after, "specmoe_host_rows_bytes") > 0  # the rows expert copies land in
