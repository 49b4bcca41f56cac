"""`probs_from_logits`: temperature, top-k and top-p filtering give exactly the distribution their definitions
say, worked out by hand on small rows."""
from __future__ import annotations

import math

import pytest
import torch

from specmoe.decoding.runtime.sampling import SamplingParams, probs_from_logits


def softmax(xs):
    e = [math.exp(x - max(xs)) for x in xs]
    return [v / sum(e) for v in e]


def close(got, want):
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float32), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("t", [0.5, 1.0, 2.0])
def test_temperature_divides_the_logits(t):
    logits = [0.0, 1.0, 3.0, -2.0]
    close(probs_from_logits(torch.tensor([logits]), SamplingParams(temperature=t))[0], softmax([x / t for x in logits]))


def test_top_k_keeps_the_k_largest_and_their_ties():
    got = probs_from_logits(torch.tensor([[3.0, 1.0, 2.0, 0.0]]), SamplingParams(temperature=1.0, top_k=2))[0]
    a, b = softmax([3.0, 2.0])
    close(got, [a, 0.0, b, 0.0])
    tied = probs_from_logits(torch.tensor([[3.0, 2.0, 2.0, 0.0]]), SamplingParams(temperature=1.0, top_k=2))[0]
    a, b, c = softmax([3.0, 2.0, 2.0])  # the k-th value is shared: both tokens holding it stay
    close(tied, [a, b, c, 0.0])
    close(probs_from_logits(torch.tensor([[3.0, 1.0]]), SamplingParams(temperature=1.0, top_k=5))[0],
          softmax([3.0, 1.0]))  # k past the vocabulary: no filter


def test_top_p_keeps_the_smallest_prefix_that_reaches_p():
    logits = torch.log(torch.tensor([[0.2, 0.5, 0.3]]))
    close(probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.6))[0], [0.0, 0.5 / 0.8, 0.3 / 0.8])
    close(probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.4))[0], [0.0, 1.0, 0.0])
    close(probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.9))[0], [0.2, 0.5, 0.3])


def test_top_k_then_top_p():
    """top-k first, then top-p over what top-k left (renormalised)."""
    logits = torch.log(torch.tensor([[0.1, 0.4, 0.3, 0.2]]))
    got = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=3, top_p=0.5))[0]
    close(got, [0.0, 0.4 / 0.7, 0.3 / 0.7, 0.0])  # top-3: 4/9, 3/9, 2/9; 4/9 < 0.5, so 3/9 joins
