"""Sampled speculation that really speculates: the acceptance step against a draft q ≠ p converges to
the target (greedy, seeded and unseeded rows in one ragged batch), engine runs at temperature > 0 draft
and reject, and a seeded request's tokens depend on nothing but its own prompt and seed."""
from __future__ import annotations

import random

import pytest
import torch

from specmoe import LLM, SamplingParams
from specmoe.decoding.runtime.sampling import coupled_noise, coupled_pick
from specmoe.decoding.runtime.sequence import Sequence
from specmoe.decoding.trees.tree import accept as tree_accept, chain

V, G = 8, 3


def accept(seqs, drafts, qs, logits, gammas, noise):
    """The step's acceptance (`tree.accept`) over chains: row b drafted drafts[b, :gammas[b]], unseeded rows
    from qs[b]."""
    trees = [chain(drafts[b, :g].tolist(), qs[b, :g] if not s.params.greedy and b not in noise else None)
             for b, (s, g) in enumerate(zip(seqs, gammas))]
    depths = torch.arange(logits.shape[1]).expand(len(seqs), -1)
    return tree_accept(seqs, trees, logits, depths, noise)[1]


def _tv(samples: torch.Tensor, p: torch.Tensor) -> float:
    emp = torch.bincount(samples, minlength=p.numel()).float() / max(samples.numel(), 1)
    return 0.5 * (emp - p).abs().sum().item()


def _dists(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    p = torch.softmax(torch.randn(G + 1, V, generator=g) * 2, -1)  # target per position (context-free)
    q = torch.softmax(torch.randn(G, V, generator=g) * 2, -1)      # a poor draft: q ≠ p
    assert 0.5 * (p[:G] - q).abs().sum(-1).min() > 0.2, "the draft must differ from the target"
    return p, q


def _batch(n: int, p: torch.Tensor, q: torch.Tensor, offset: int):
    """A ragged batch of 3n rows: greedy, seeded (coupled rule) and unseeded (rejection) rows interleaved,
    γ_b cycling over 1..G, drafts made the way `specmoe.draft` makes them."""
    gen = torch.Generator().manual_seed(offset)
    seqs, gammas, drafts, noise = [], [], torch.zeros(3 * n, G, dtype=torch.long), {}
    qs = torch.zeros(3 * n, G, V)
    for i in range(3 * n):
        kind = ("greedy", "seeded", "unseeded")[i % 3]
        sp = SamplingParams(max_tokens=8, temperature=0.0 if kind == "greedy" else 1.0,
                            seed=offset + i if kind == "seeded" else None)
        s = Sequence(seq_id=i, prompt_ids=[1], params=sp, slot=i,
                     generator=torch.Generator().manual_seed(10_000 + offset + i), output_ids=[1])
        g = 1 + (i // 3) % G
        if kind == "greedy":
            drafts[i, :g] = q[:g].argmax(-1)
        elif kind == "seeded":
            noise[i] = coupled_noise(sp.seed, 1, g + 1, V)
            drafts[i, :g] = coupled_pick(torch.log(q[:g]), sp, noise[i][:g])
        else:
            qs[i] = q
            drafts[i, :g] = torch.multinomial(q[:g], 1, generator=gen)[:, 0]
        seqs.append(s)
        gammas.append(g)
    logits = torch.log(p).expand(3 * n, G + 1, V).clone()  # temperature 1: probs_from_logits(logits) == p
    return seqs, drafts, qs, logits, gammas, noise


@pytest.mark.parametrize("rule", ["seeded", "unseeded"])
def test_accept_converges_to_target_with_greedy_rows_in_the_batch(rule):
    p, q = _dists()
    tvs, stats = [], {}
    for n in (300, 12_000):
        seqs, drafts, qs, logits, gammas, noise = _batch(n, p, q, offset=n)
        out = accept(seqs, drafts, qs, logits, gammas, noise)
        rows = [b for b, s in enumerate(seqs) if (s.params.seed is not None) == (rule == "seeded")
                and not s.params.greedy]
        for b in range(0, len(seqs), 3):  # greedy rows: longest prefix of drafts equal to argmax p, + argmax p
            want, t = [], p.argmax(-1).tolist()
            for j in range(gammas[b]):
                if drafts[b, j] != t[j]:
                    break
                want.append(t[j])
            assert out[b] == want + [t[len(want)]]
        first = torch.tensor([out[b][0] for b in rows])
        second = torch.tensor([out[b][1] for b in rows if len(out[b]) > 1])
        tvs.append((_tv(first, p[0]), _tv(second, p[1])))
        accepted = [len(out[b]) - 1 for b in rows]
        stats[n] = (sum(accepted), sum(gammas[b] for b in rows), sum(a < gammas[b] for a, b in zip(accepted, rows)))
    (a0, a1), (b0, b1) = tvs
    big = stats[12_000]
    assert 0 < big[0] < big[1] and big[2] > 0, f"drafts must be both accepted and rejected: {big}"
    assert b0 < 0.02 and b1 < 0.03, tvs
    assert b0 < a0 and b1 < a1, f"the distance to p must shrink as samples grow: {tvs}"


def prompts(n: int, seed: int, max_len: int = 10) -> list[list[int]]:
    r = random.Random(seed)
    return [[r.randrange(96) for _ in range(r.randint(2, max_len))] for _ in range(n)]


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_seeded_request_is_independent_of_neighbours_and_decoding_mode(tiny_ckpt, family):
    """A seeded request alone, or among neighbours (greedy, unseeded, other seeds), under ar, specmoe and
    auto: the same tokens every time (the coupled rule makes speculation drafter-invariant)."""
    path = tiny_ckpt(family)
    mine, sp = [3, 14, 15, 92, 65], SamplingParams(max_tokens=16, temperature=1.0, top_p=0.95, seed=1234)
    others = prompts(5, 9)
    oparams = [SamplingParams(max_tokens=m, temperature=t, seed=sd) for m, t, sd in
               [(9, 0.0, None), (20, 0.8, None), (16, 1.0, 7), (3, 1.2, None), (12, 0.5, 99)]]
    got = {}
    for decoding in ("ar", "specmoe", "auto"):
        llm = LLM(path, decoding=decoding, num_draft_tokens=3, draft_experts=2)
        alone = llm.generate([mine], sp)[0].token_ids
        crowd = llm.generate(others[:2] + [mine] + others[2:], oparams[:2] + [sp] + oparams[2:])[2].token_ids
        assert alone == crowd, f"{decoding}: a seeded request changed with its batch neighbours"
        got[decoding] = alone
        if decoding == "specmoe":
            st = llm.stats
            assert st["drafted_tokens"] > 0 and 0 < st["accepted_tokens"] < st["drafted_tokens"], st
    assert got["ar"] == got["specmoe"] == got["auto"], got


def test_unseeded_sampled_specmoe_drafts_rejects_and_follows_target(tiny_ckpt):
    """Unseeded rows use rejection sampling. The 2nd token comes from a speculative step (γ ≥ 1): its law
    must be the target's given the first token."""
    path = tiny_ckpt("mixtral")
    prompt, n = [5, 17, 33], 400
    llm = LLM(path, decoding="specmoe", num_draft_tokens=2, draft_experts=2)
    spec = llm.generate([prompt] * n, SamplingParams(max_tokens=3, temperature=1.0))
    st = llm.stats
    assert st["drafted_tokens"] >= n, "every sequence drafted in its speculative step"
    assert 0 < st["accepted_tokens"] < st["drafted_tokens"], "some drafts accepted, some rejected"
    logits = LLM(path, decoding="ar").logits([prompt + [o.token_ids[0]] for o in spec])  # [n, T, V]
    p = torch.softmax(logits[:, len(prompt)], -1)  # target law of each second token given the first
    # E[p(x)] under the right law equals E[Σ p²]; accepting drafts unchecked drifts towards the draft's law
    got = torch.tensor([p[i, o.token_ids[1]].item() for i, o in enumerate(spec)])
    want = (p * p).sum(-1)
    assert abs(got.mean() - want.mean()) < 4 * got.std() / n ** 0.5 + 1e-3
