"""The EAGLE-1 head's reduced draft vocabulary (`eagle_draft_vocab=N`): the N most frequent target tokens
(`draft_vocab.safetensors` beside the shipped head), scored with only their rows of the target's LM head.
Greedy speculation still equals plain greedy decoding (fp32) at batch 1, 7 (ragged) and 64 with drafts
accepted and rejected; every proposal lies in the chosen set; the head's draft scores equal the full LM head's
on those rows; seeded sampled rows equal plain decoding; option errors."""
from __future__ import annotations

import pytest
import torch

from specmoe import LLM, SamplingParams
from specmoe.bundled import demo_eagle_dir
from specmoe.decoding.drafters.eagle import EagleDrafter
from specmoe.errors import CheckpointError, InputError, UnsupportedModelError
from specmoe.models.eagle import DRAFT_VOCAB, load_eagle_head, read_draft_vocab, recommended_draft_vocab
from tests.decoding.eagle_cases import BATCHES, prompts


@pytest.fixture(scope="module")
def ar_llm():
    return LLM(dtype="float32", threads=1)


class Spy:
    """Records every proposal's drafted tokens."""

    def __init__(self, monkeypatch):
        self.drafts: list[torch.Tensor] = []
        orig = EagleDrafter.propose_tree

        def spy(drafter, seqs, gammas, width, noise, hook=None):
            trees = orig(drafter, seqs, gammas, width, noise, hook)
            self.drafts += [torch.tensor(t.tokens, dtype=torch.long) for t in trees]
            return trees
        monkeypatch.setattr(EagleDrafter, "propose_tree", spy)


@pytest.mark.parametrize("batch,gamma,n", [(1, 4, 512), (7, 3, 1024), (64, 4, 256)])
def test_reduced_vocab_greedy_equals_plain_and_drafts_stay_in_the_set(ar_llm, monkeypatch, batch, gamma, n):
    ps, sp = BATCHES[batch]
    ref = [o.token_ids for o in ar_llm.generate(ps, sp)]
    spy = Spy(monkeypatch)
    llm = LLM(dtype="float32", threads=1, decoding="specmoe", drafter="eagle", num_draft_tokens=gamma,
              eagle_draft_vocab=n)
    assert [o.token_ids for o in llm.generate(ps, sp)] == ref
    s = llm.stats
    assert s["eagle_draft_vocab"] == n
    assert s["drafted_tokens"] > 0 and 0 < s["accepted_tokens"] < s["drafted_tokens"]
    allowed = read_draft_vocab(demo_eagle_dir(), n, llm.config.vocab_size)
    drafted = torch.cat(spy.drafts)
    assert drafted.numel() > 0 and torch.isin(drafted, allowed).all(), "a draft outside the reduced vocabulary"
    head = next(v for k, v in llm.draft_memo.items() if k[0] == "eagle")
    assert head.lm_head.weight.shape == (n, llm.config.hidden_size) and head.lm_head.weight.is_contiguous()


def test_full_vocab_option_and_draft_scores(ar_llm):
    V = ar_llm.config.vocab_size
    llm = LLM(dtype="float32", threads=1, decoding="specmoe", drafter="eagle", eagle_draft_vocab=0)
    llm.generate(prompts(2), SamplingParams(max_tokens=6, ignore_eos=True))
    assert llm.stats["eagle_draft_vocab"] == V
    head = next(v for k, v in llm.draft_memo.items() if k[0] == "eagle")
    assert head.lm_head is None
    # the reduced head's scores are the full LM head's on its rows, -inf elsewhere
    w = ar_llm.model.head_weight()
    red = load_eagle_head(demo_eagle_dir(), target_vocab=V, target_hidden=ar_llm.config.hidden_size)
    ids = read_draft_vocab(demo_eagle_dir(), 300, V)
    red.restrict_vocab(w, ids)
    x = torch.randn(5, ar_llm.config.hidden_size)
    full, got = torch.nn.functional.linear(x, w.float()), red.logits(x, w)  # w: the stored bf16 head on CPU
    keep = torch.zeros(V, dtype=torch.bool)
    keep[ids] = True
    assert torch.allclose(got[:, keep], full[:, keep], atol=1e-4) and torch.isinf(got[:, ~keep]).all()
    pick = red.to_target(red.draft_logits(x, w).argmax(-1))
    assert torch.equal(pick, full.masked_fill(~keep, float("-inf")).argmax(-1))
    with pytest.raises(UnsupportedModelError):
        red.restrict_vocab(w, ids)  # already reduced


def test_reduced_vocab_seeded_sampling_equals_plain(ar_llm):
    ps = prompts(3)
    sp = [SamplingParams(max_tokens=12, temperature=0.8, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    ref = [o.token_ids for o in ar_llm.generate(ps, sp)]
    llm = LLM(dtype="float32", threads=1, decoding="specmoe", drafter="eagle", num_draft_tokens=3,
              eagle_draft_vocab=256)
    assert [o.token_ids for o in llm.generate(ps, sp)] == ref
    assert llm.stats["drafted_tokens"] > 0 and llm.stats["eagle_draft_vocab"] == 256


def test_shipped_ranking_and_option_errors(tmp_path):
    V = 8192
    f = demo_eagle_dir() / DRAFT_VOCAB
    from safetensors.torch import load_file
    ranking = load_file(str(f))["token_ids"]
    assert sorted(ranking.tolist()) == list(range(V)), "the ranking lists every target id once"
    rec = recommended_draft_vocab(demo_eagle_dir())
    assert 0 < rec < V
    llm = LLM(dtype="float32", threads=1, decoding="specmoe", drafter="eagle")  # default: the recommended N
    llm.generate(prompts(1), SamplingParams(max_tokens=6, ignore_eos=True))
    assert llm.stats["eagle_draft_vocab"] == rec
    import argparse

    from specmoe.cli.common import add_option_args, option_kwargs
    ap = argparse.ArgumentParser()
    add_option_args(ap)
    assert option_kwargs(ap.parse_args(["--eagle-draft-vocab", "1024"]))["eagle_draft_vocab"] == 1024
    with pytest.raises(InputError, match="eagle_draft_vocab"):
        LLM(drafter="eagle", decoding="specmoe", eagle_draft_vocab=-1)
    with pytest.raises(InputError, match="applies to drafter='eagle'"):
        LLM(drafter="ngram", decoding="specmoe", eagle_draft_vocab=512)
    llm = LLM(dtype="float32", threads=1, decoding="specmoe", drafter="eagle", eagle_draft_vocab=V)
    with pytest.raises(CheckpointError, match="eagle_draft_vocab=8192"):
        llm.generate(prompts(1), SamplingParams(max_tokens=2))
    # a head directory without the ranking file: explicit N is refused, the default is the full vocabulary
    for p in demo_eagle_dir().glob("*.json"):
        (tmp_path / p.name).write_bytes(p.read_bytes())
    (tmp_path / "model.safetensors").symlink_to(demo_eagle_dir() / "model.safetensors")
    assert recommended_draft_vocab(tmp_path) == 0
    llm = LLM(dtype="float32", threads=1, decoding="specmoe", drafter="eagle", eagle_head=str(tmp_path),
              eagle_draft_vocab=128)
    with pytest.raises(CheckpointError, match=DRAFT_VOCAB):
        llm.generate(prompts(1), SamplingParams(max_tokens=2))
