"""The ngram drafter end to end: greedy SpecMoE with prompt/output lookup equals plain greedy decoding on
the demo model (fp32; batch 1, 7 ragged, 64; drafts both accepted and rejected, empty proposals verify only
the pending token), unseeded sampled rows follow the target (one-hot q rejection sampling), and the
proposal's shape rules."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from specmoe import LLM, SamplingParams
from specmoe.decoding.drafters.ngram import NgramDrafter
from specmoe.decoding.drafters.ngram import propose as ngram_propose
from specmoe.decoding.runtime.sequence import Sequence
from specmoe.errors import InputError

PROMPTS = Path(__file__).resolve().parents[2] / "benchmarks" / "prompts"


def code_prompts(n: int) -> list[str]:
    lines = (PROMPTS / "code.jsonl").read_text().splitlines()
    return [json.loads(line)["prompt"] for line in lines[:n]]


BATCHES = {  # batch: (prompts, params); 7 is ragged in prompts and max_tokens
    1: (code_prompts(1), SamplingParams(max_tokens=40, ignore_eos=True)),
    7: (code_prompts(7), [SamplingParams(max_tokens=m, ignore_eos=True) for m in (1, 3, 8, 13, 21, 30, 40)]),
    64: (code_prompts(64), SamplingParams(max_tokens=10, ignore_eos=True)),
}


@pytest.fixture(scope="module")
def ar_llm():
    return LLM(dtype="float32", threads=1)


@pytest.mark.parametrize("batch,gamma,n_min,selection", [(1, 4, 2, "all"), (1, 4, 2, "cost"), (7, 5, 1, "cost"),
                                                         (64, 3, 2, "all")])
def test_ngram_greedy_equals_plain_greedy(ar_llm, batch, gamma, n_min, selection):
    prompts, sp = BATCHES[batch]
    ref = [o.token_ids for o in ar_llm.generate(prompts, sp)]
    llm = LLM(dtype="float32", threads=1, decoding="specmoe", drafter="ngram", num_draft_tokens=gamma,
              ngram_min=n_min, ngram_max=4, draft_selection=selection)
    got = [o.token_ids for o in llm.generate(prompts, sp)]
    assert got == ref
    s = llm.stats
    assert s["drafter"] == "ngram" and s["decoding"] == "specmoe"
    assert s["drafted_tokens"] > 0, "the lookup must have proposed drafts"
    assert 0 < s["accepted_tokens"] < s["drafted_tokens"], "drafts must be both accepted and rejected"
    assert s["draft_phase_bytes"] == 0 and s["steps"] > 0
    assert 1.0 < s["tokens_per_step"] <= gamma + 1
    assert len(s["acceptance_per_position"]) == gamma and s["drafted_per_position"][0] >= s["drafted_per_position"][-1]
    assert s["draft_selection"] == selection
    if selection == "all":
        assert s["draft_tokens_proposed"] == s["drafted_tokens"] <= s["draft_tokens_asked"]
    else:
        assert s["draft_tokens_proposed"] == s["drafted_tokens"] + s["selection_cut_tokens"]
    if batch > 1:
        assert s["empty_proposals"] > 0, "some rows find no match and verify only their pending token"
        assert s["verified_positions_per_step"] < gamma + 1


def test_ngram_offloaded_counts_expert_bytes_per_token(tmp_path):
    prompts, sp = BATCHES[1]
    stats = {}
    for name, kw in (("ar", {}), ("ngram", dict(decoding="specmoe", drafter="ngram"))):
        llm = LLM(dtype="float32", threads=1, offload="disk", repack_dir=str(tmp_path / "r"), cache_experts=8,
                  cache_policy="lru", **kw)
        llm.generate(prompts, sp)
        stats[name] = llm.stats
    s = stats["ngram"]
    assert s["expert_bytes_per_token"] > 0 and s["draft_phase_bytes"] == 0
    assert s["tokens_per_step"] > 1.0


def test_unseeded_sampled_ngram_follows_target(ar_llm):
    """A code prompt (repeated tokens: the lookup proposes); sampled unseeded rows must still draw the 2nd
    token from the target's law given the 1st (which comes from prefill, i.e. from the target)."""
    prompt = ar_llm.tokenizer.encode(code_prompts(1)[0])
    n, sp = 600, SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True)
    llm = LLM(dtype="float32", threads=1, decoding="specmoe", drafter="ngram", num_draft_tokens=1, ngram_min=1)
    outs = [o.token_ids for o in llm.generate([prompt] * n, sp)]
    s = llm.stats
    assert s["drafted_tokens"] > 0 and 0 < s["accepted_tokens"] < s["drafted_tokens"], s
    # the target's law of token 2 given token 1, from plain forwards; the lookup's draft d given token 1
    # is deterministic, so rejection sampling must emit d with probability p(d), not more
    firsts = [f for f in sorted({o[0] for o in outs}) if sum(o[0] == f for o in outs) >= 100]
    assert firsts
    logits = ar_llm.logits([prompt + [f] for f in firsts])
    for f, lg in zip(firsts, logits):
        seconds = torch.tensor([o[1] for o in outs if o[0] == f])
        m = len(seconds)
        p = torch.softmax(lg[len(prompt)].float(), -1)
        d = ngram_propose(prompt + [f], 1, n_min=1)[0]
        emp = (seconds == d).float().mean().item()
        sigma = (p[d].item() * (1 - p[d].item()) / m) ** 0.5
        assert abs(emp - p[d].item()) < 4 * sigma + 1e-3, (f, d, m, emp, p[d].item())
        # and the whole law: TV to p no larger than that of as many plain samples from p (plus noise)
        g = torch.Generator().manual_seed(f)
        plain = torch.multinomial(p, m, replacement=True, generator=g)
        tv_spec = 0.5 * (torch.bincount(seconds, minlength=p.numel()) / m - p).abs().sum().item()
        tv_plain = 0.5 * (torch.bincount(plain, minlength=p.numel()) / m - p).abs().sum().item()
        assert tv_spec < tv_plain + 0.12, (tv_spec, tv_plain)  # 5 sigma of the difference


def test_ngram_proposes_deterministic_chains_and_shorter_proposals():
    d = NgramDrafter(vocab_size=20, device=torch.device("cpu"), n_min=1, n_max=3)

    def seq(i, prompt, out, **kw):
        return Sequence(seq_id=i, prompt_ids=prompt, params=SamplingParams(max_tokens=8, **kw), slot=i,
                        generator=torch.Generator().manual_seed(i), output_ids=out)
    seqs = [seq(0, [1, 2, 3, 1, 2], [3]),                       # greedy: [1, 2] after "3"... then "3"
            seq(1, [4, 5, 6], [7], temperature=1.0),            # unseeded, no match: empty
            seq(2, [8, 9, 8], [9], temperature=1.0),            # unseeded: proposes 8, 9 (history end)
            seq(3, [1, 2, 1], [2], temperature=1.0, seed=3)]    # seeded: exact-match rule
    assert d.available(seqs, [4, 4, 4, 4]) == [3, 0, 2, 2]
    trees = d.propose_tree(seqs, [4, 4, 4, 4], 1, {3: torch.zeros(5, 20)})
    assert [len(t) for t in trees] == [3, 0, 2, 2] and all(t.is_chain for t in trees)
    assert trees[0].tokens == [1, 2, 3] and trees[2].tokens == [8, 9]
    assert all(t.q is None for t in trees), "a lookup's q is the one-hot of its token (rejection: q = δ)"
    # the next call feeds only new tokens; a sequence gone from the batch is dropped by retire
    seqs[0].output_ids.append(1)
    d.retire({0})
    d.propose_tree(seqs[:1], [2], 1, {})
    assert list(d.index) == [0] and d.index[0].tokens == [1, 2, 3, 1, 2, 3, 1]
    fresh = seq(0, [7, 7], [7])  # a new sequence under a reused id starts a new index
    assert d.propose_tree([fresh], [3], 1, {})[0].tokens == [7] and d.index[0].tokens == [7, 7, 7]
    assert d.stats()["empty_proposals"] == 1


def test_ngram_options_are_checked():
    with pytest.raises(InputError):
        LLM(drafter="medusa")
    with pytest.raises(InputError):
        LLM(drafter="ngram", ngram_min=3, ngram_max=2)


def test_selector_cuts_costly_unlikely_chain_drafts_and_keeps_cheap_likely_ones():
    """Chains are trees of width 1: the one cost-aware selector picks their prefixes."""
    from specmoe.decoding.trees.tree import chain
    from specmoe.decoding.trees.treeselect import TreeSelector

    def lens(sel, gammas):
        return [len(t) for t in sel.choose_trees([chain(list(range(10, 10 + g))) for g in gammas])]
    sel = TreeSelector(4, 1, experts=False)
    assert lens(sel, [4, 2, 0]) == [4, 2, 0], "before a fit, every proposal is verified"
    for i in range(8):  # verification costs 1 s + 1 s per row; drafts are never accepted
        pos = 1 + i % 4
        t = chain(list(range(pos - 1)))
        sel.record_trees([t], pos, 1.0 + pos)
        sel.accs["self"].record([0], [len(t)], [0], [[]], [t], [[0]])  # (the decoder records acceptance)
    assert sel.cost() == pytest.approx((1.0, 1.0))
    assert lens(sel, [4, 3]) == [0, 0]
    for _ in range(5):
        assert lens(sel, [1]) == [0]
    assert lens(sel, [4, 3]) == [4, 3], "every 8th step explores"
    cheap = TreeSelector(4, 1, experts=False)
    for i in range(8):  # rows nearly free, drafts always accepted
        pos = 1 + i % 5
        t = chain(list(range(pos - 1)))
        cheap.record_trees([t], pos, 1.0 + 0.01 * pos)
        cheap.accs["self"].record([0], [len(t)], [len(t)], [[]], [t], [list(range(pos))])
    assert lens(cheap, [4, 1, 0]) == [4, 1, 0]
    assert cheap.stats()["selection_cut_tokens"] == 0 and sel.stats()["selection_cut_tokens"] == 12


def test_self_drafter_is_named_in_stats():
    llm = LLM(dtype="float32", threads=1, decoding="specmoe", num_draft_tokens=2)
    llm.generate(code_prompts(1), SamplingParams(max_tokens=6, ignore_eos=True))
    assert llm.stats["drafter"] == "self" and llm.stats["drafted_tokens"] > 0
