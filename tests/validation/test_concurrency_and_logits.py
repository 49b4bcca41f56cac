"""One engine used from two threads, and logits() for more sequences than max_batch with
different lengths: same tokens / logits as running each request alone."""
import threading

import pytest
import torch

from specmoe import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return LLM(tiny_ckpt("qwen3_moe"), dtype="float32", max_batch=3)


def test_generate_from_two_threads_is_serialised(llm):
    """Both threads share the engine's KV cache; without the lock they overwrite each other's
    keys and return wrong tokens. With it each thread gets exactly its sequential result."""
    prompts = {0: [[1, 2, 3, 4, 5, 6, 7], [9, 10]], 1: [[40, 41], [60, 61, 62, 63, 64], [70]]}
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = {k: [o.token_ids for o in llm.generate(p, params)] for k, p in prompts.items()}
    got, errors = {}, []
    barrier = threading.Barrier(2)

    def work(k):
        try:
            barrier.wait()
            for _ in range(3):
                got.setdefault(k, []).append([o.token_ids for o in llm.generate(prompts[k], params)])
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)
    threads = [threading.Thread(target=work, args=(k,)) for k in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    for k in prompts:
        assert got[k] == [expected[k]] * 3


def test_logits_and_generate_from_two_threads(llm):
    ids = [[3, 4, 5, 6], [7, 8]]
    ref = llm.logits(ids)
    ref_gen = llm.generate([[11, 12, 13]], SamplingParams(max_tokens=10, ignore_eos=True))[0].token_ids
    out, errors = {}, []

    def scorer():
        try:
            out["logits"] = [llm.logits(ids) for _ in range(4)]
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    def generator():
        try:
            out["gen"] = [llm.generate([[11, 12, 13]], SamplingParams(max_tokens=10, ignore_eos=True))[0].token_ids
                          for _ in range(4)]
        except Exception as e:  # noqa: BLE001
            errors.append(e)
    ts = [threading.Thread(target=scorer), threading.Thread(target=generator)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    assert not errors, errors
    assert all(torch.equal(x, ref) for x in out["logits"]) and out["gen"] == [ref_gen] * 4


def test_logits_more_sequences_than_max_batch(llm):
    """7 sequences of different lengths with max_batch=3: three chunks, padded to the longest overall."""
    ids = [[1] * 2, [2, 3, 4, 5, 6, 7, 8, 9], [10], [11, 12, 13], [14] * 5, [15, 16], [17, 18, 19, 20, 21, 22]]
    out = llm.logits(ids)
    assert out.shape == (7, 8, llm.config.vocab_size)
    for b, t in enumerate(ids):
        alone = llm.logits([t])[0]
        torch.testing.assert_close(out[b, :len(t)], alone, rtol=1e-5, atol=1e-5)
        assert torch.all(out[b, len(t):] == 0)
