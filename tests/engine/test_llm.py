"""LLM API behaviour: batching, sampling, stops, input validation, stats."""
import pytest
import torch

from specmoe import LLM, SamplingParams
from specmoe.errors import InputError


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return LLM(tiny_ckpt("qwen3_moe"), dtype="float32", max_batch=8)


def test_seeded_sampling_repeats(llm):
    p = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=20, seed=1234, ignore_eos=True)
    a = llm.generate([[1, 2, 3], [4, 5]], p)
    b = llm.generate([[1, 2, 3], [4, 5]], p)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    c = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(**{**p.__dict__, "seed": 99}))
    assert [o.token_ids for o in a] != [o.token_ids for o in c]
    # a request's tokens do not depend on its batch neighbours
    solo = llm.generate([[1, 2, 3]], p)
    assert solo[0].token_ids == a[0].token_ids


def test_batch_equals_single_greedy(llm):
    prompts = [[7, 8, 9, 10, 11], [3], [50, 51, 52]]
    batch = llm.generate(prompts, SamplingParams(max_tokens=10, ignore_eos=True))
    for p, o in zip(prompts, batch):
        assert llm.generate([p], SamplingParams(max_tokens=10, ignore_eos=True))[0].token_ids == o.token_ids


def test_more_requests_than_slots_join_between_steps(llm):
    prompts = [[i + 1, i + 2] for i in range(19)]  # max_batch=8: requests queue and join as others finish
    params = [SamplingParams(max_tokens=3 + i % 5, ignore_eos=True) for i in range(19)]
    outs = llm.generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == [3 + i % 5 for i in range(19)]
    for p, sp, o in list(zip(prompts, params, outs))[::6]:
        assert llm.generate([p], sp)[0].token_ids == o.token_ids


def test_eos_stops(tiny_ckpt):
    llm = LLM(tiny_ckpt("qwen3_moe"), dtype="float32")
    free = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    llm.eos_token_ids = {free[3]}
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=8))[0]
    assert out.token_ids == free[: free.index(free[3]) + 1] and out.finish_reason == "stop"


def test_logits_shape_and_padding(llm):
    out = llm.logits([[1, 2, 3, 4], [5, 6]])
    assert out.shape == (2, 4, llm.config.vocab_size) and out.dtype == torch.float32
    assert torch.all(out[1, 2:] == 0)


def test_input_errors(llm):
    with pytest.raises(InputError, match="empty prompt list"):
        llm.generate([])
    with pytest.raises(InputError, match="prompt 1 is empty"):
        llm.generate([[1], []])
    with pytest.raises(InputError, match="context length is 256"):
        llm.generate([[1] * 300])
    with pytest.raises(InputError, match="outside the vocabulary"):
        llm.generate([[1, 10_000]])
    with pytest.raises(InputError, match="no tokenizer.json"):
        llm.generate(["hello"])
    with pytest.raises(InputError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(InputError, match="unknown option"):
        LLM(llm.path, not_an_option=3)


def test_generation_stops_at_context_end(llm):
    out = llm.generate([[1] * 250], SamplingParams(max_tokens=50, ignore_eos=True))[0]
    assert len(out.token_ids) == 6 and out.finish_reason == "length"


def test_stats(llm):
    llm.reset_stats()
    llm.generate([[1, 2], [3, 4]], SamplingParams(max_tokens=5, ignore_eos=True))
    s = llm.stats
    assert s["generated_tokens"] == 10 and s["prompt_tokens"] == 4 and s["requests"] == 2
    assert s["decode_steps"] == 4 and s["tokens_per_s"] > 0 and s["decode_time_s"] > 0


def test_padding_is_not_routed(llm):
    """A ragged batch pads short sequences; padding must not be routed, counted or fetched."""
    llm.reset_stats()
    llm.logits([[1, 2, 3, 4, 5], [6]])  # 6 real tokens, 4 padding
    counts = llm.stats["expert_counts"]
    assert len(counts) == len(llm.config.moe_layers)
    assert all(sum(row) == 6 * llm.config.top_k for row in counts)


def test_logits_scores_a_prompt_of_exactly_the_context_length(tiny_ckpt):
    """Scoring generates nothing: a prompt filling the whole context is scored (generation still refuses it)."""
    llm = LLM(tiny_ckpt("qwen3_moe"), dtype="float32", max_model_len=16)
    ids = [(7 * i) % 90 + 1 for i in range(16)]
    full = llm.logits([ids])[0]
    assert full.shape == (16, llm.config.vocab_size)
    assert torch.allclose(full[:15], llm.logits([ids[:15]])[0], atol=1e-5)  # causal: the prefix is unchanged
    with pytest.raises(InputError, match="context length is 16"):
        llm.logits([ids + [1]])
    with pytest.raises(InputError, match="at least one generated token"):
        llm.generate([ids])


@pytest.mark.parametrize("seed", [None, 5])
def test_tiny_positive_temperature_is_the_greedy_limit(llm, seed):
    """logits / 1e-45 overflows; sampling takes the limit instead (the top token), with top-k and top-p too."""
    greedy = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=8, ignore_eos=True))
    for t in (1e-45, 1e-38):
        tiny = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=8, temperature=t, top_k=5, top_p=0.9,
                                                                seed=seed, ignore_eos=True))
        assert [o.token_ids for o in tiny] == [o.token_ids for o in greedy]


def test_probs_from_logits_is_finite_at_tiny_temperature():
    from specmoe.decoding.runtime.sampling import probs_from_logits
    logits = torch.tensor([[1.0, 3.0, 3.0, -2.0], [1e30, -1e30, 0.0, 5.0]])
    p = probs_from_logits(logits, SamplingParams(temperature=1e-45))
    assert torch.equal(p, torch.tensor([[0.0, 0.5, 0.5, 0.0], [1.0, 0.0, 0.0, 0.0]]))  # ties share the mass
