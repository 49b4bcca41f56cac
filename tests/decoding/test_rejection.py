"""The verification rules as pure functions (vLLM-style rejection-sampler tests)."""
from __future__ import annotations

import torch

from specmoe.decoding.rejection import greedy_accept, rejection_sample


def test_greedy_accept_prefix_and_padding():
    drafts = torch.tensor([[1, 2, 3], [1, 9, 3], [5, 5, 5], [1, 2, 3]])
    target = torch.tensor([[1, 2, 3, 4], [1, 2, 3, 4], [6, 5, 5, 5], [1, 2, 3, 4]])
    n = greedy_accept(drafts, target, torch.tensor([3, 3, 3, 2]))
    assert n.tolist() == [3, 1, 0, 2]  # all + bonus; stop at the first mismatch; padding never accepted


def _emitted_first_two(draft, q, p, gen):
    n, nxt = rejection_sample(draft, q, p, gen)
    first = torch.where(n >= 1, draft[:, 0], nxt)
    second = torch.where(n >= 2, draft[:, 1], nxt)
    return first, second, n


def _tv(samples: torch.Tensor, p: torch.Tensor) -> float:
    emp = torch.bincount(samples, minlength=p.numel()).float() / samples.numel()
    return 0.5 * (emp - p).abs().sum().item()


def test_rejection_sampling_matches_target_distribution():
    V, G = 8, 2
    g = torch.Generator().manual_seed(0)
    p_row = torch.softmax(torch.randn(G + 1, V, generator=g) * 2, -1)  # target, fixed per position
    q_row = torch.softmax(torch.randn(G, V, generator=g) * 2, -1)      # a poor draft
    tvs = []
    for B in (500, 200_000):
        q = q_row.expand(B, G, V)
        p = p_row.expand(B, G + 1, V)
        draft = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(B, G)
        first, second, n = _emitted_first_two(draft, q, p, g)
        # emitted token 0 ~ p[0]; token 1 (emitted only when token 0 was accepted) ~ p[1]
        tvs.append((_tv(first, p_row[0]), _tv(second[n >= 1], p_row[1])))
    (a0, a1), (b0, b1) = tvs
    assert b0 < 0.01 and b1 < 0.015, tvs
    assert b0 < a0 and b1 < a1, f"distance must shrink as samples grow: {tvs}"


def test_rejection_sampling_identical_draft_accepts_all_and_bonus_from_p():
    V, G, B = 6, 3, 50_000
    g = torch.Generator().manual_seed(1)
    p_row = torch.softmax(torch.randn(G + 1, V, generator=g), -1)
    q = p_row[:G].expand(B, G, V)
    draft = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(B, G)
    n, nxt = rejection_sample(draft, q, p_row.expand(B, G + 1, V), g)
    assert (n == G).all()
    assert _tv(nxt, p_row[G]) < 0.01


def test_rejection_sampling_never_emits_outside_target_support():
    V, G, B = 5, 2, 20_000
    g = torch.Generator().manual_seed(2)
    p = torch.tensor([0.5, 0.5, 0.0, 0.0, 0.0]).expand(B, G + 1, V)  # e.g. after top-k filtering
    q = torch.full((B, G, V), 1 / V)
    draft = torch.multinomial(q.reshape(-1, V), 1, generator=g).view(B, G)
    first, second, n = _emitted_first_two(draft, q, p, g)
    assert first.max() <= 1 and second[n >= 1].max() <= 1
