"""Token trees (`draft_tree=True`) end to end: greedy tree speculation equals plain greedy decoding (demo model,
batch 1 / 7 ragged / 64, every-node and cost-aware selection; GPT-OSS's sinks + sliding windows and
DeepSeek's MLA on tiny checkpoints), trees branch, nodes are rejected and accepted and off-chain paths are
compacted; after a run the KV cache holds what plain decoding wrote; seeded rows equal plain seeded decoding;
offloaded == resident; the tree attention mask against a brute-force reference."""
from __future__ import annotations

import random

import pytest
import torch

from specmoe import LLM, SamplingParams
from specmoe.errors import InputError
from specmoe.models.decoder import BatchView, tree_attention_mask
from tests.decoding.test_drafters import BATCHES, code_prompts


@pytest.fixture(scope="module")
def ar_llm():
    return LLM(dtype="float32", threads=1)


def tree_llm(path=None, **kw):
    opts = dict(dtype="float32", threads=1, decoding="specmoe", drafter="ngram", draft_tree=True, ngram_min=1)
    return LLM(path, **{**opts, **kw})


def assert_tree_worked(s, gamma):
    assert s["draft_tree"] is True and s["drafter"] == "ngram"
    assert s["tree_branched_rows"] > 0, "some proposals must be real trees (a node with two children)"
    assert s["accepted_tokens"] > 0 and s["tree_nodes_rejected"] > 0, "nodes both accepted and rejected"
    assert s["tree_nodes_verified"] == s["accepted_tokens"] + s["tree_nodes_rejected"]
    assert s["verified_positions_per_step"] == pytest.approx(1 + s["tree_nodes_per_step"])
    assert 1.0 < s["tokens_per_step"] <= gamma + 1
    assert s["accepted_path_length"] == pytest.approx(s["tokens_per_step"] - 1)


@pytest.mark.parametrize("batch,gamma,width,selection", [(1, 4, 3, "all"), (7, 5, 3, "cost"), (7, 4, 4, "all"),
                                                         (64, 3, 2, "all"), (64, 3, 3, "cost")])
def test_tree_greedy_equals_plain_greedy(ar_llm, batch, gamma, width, selection):
    prompts, sp = BATCHES[batch]
    ref = [o.token_ids for o in ar_llm.generate(prompts, sp)]
    llm = tree_llm(num_draft_tokens=gamma, draft_tree_width=width, draft_selection=selection)
    assert [o.token_ids for o in llm.generate(prompts, sp)] == ref
    s = llm.stats
    assert_tree_worked(s, gamma)
    assert s["draft_selection"] == selection and s["draft_tree_width"] == width
    if selection == "cost":
        assert s["tree_nodes_proposed"] == s["tree_nodes_verified"] + s["selection_cut_tokens"]
    else:
        assert s["tree_nodes_proposed"] == s["tree_nodes_verified"]


@pytest.mark.parametrize("batch,selection", [(1, "all"), (7, "cost"), (64, "all")])
def test_self_draft_tree_greedy_equals_plain_greedy(ar_llm, batch, selection):
    """drafter='self' trees: the draft's chain + its next most likely tokens per depth as leaves."""
    prompts, sp = BATCHES[batch]
    ref = [o.token_ids for o in ar_llm.generate(prompts, sp)]
    llm = LLM(dtype="float32", threads=1, decoding="specmoe", draft_tree=True, num_draft_tokens=3, draft_tree_width=3,
              draft_selection=selection)
    assert [o.token_ids for o in llm.generate(prompts, sp)] == ref
    s = llm.stats
    assert s["drafter"] == "self" and s["tree_sibling_nodes"] > 0 and s["draft_forwards"] > 0
    assert s["tree_branched_rows"] > 0 and s["accepted_tokens"] > 0 and s["tree_nodes_rejected"] > 0
    assert s["tree_kv_rows_moved"] > 0, "some accepted path must end on a sibling leaf"
    assert s["draft_phase_bytes"] == 0 and s["draft_set_refreshes"] > 0


def test_self_draft_tree_offloaded_equals_resident(tmp_path):
    prompts, sp = BATCHES[7]
    kw = dict(dtype="float32", threads=1, decoding="specmoe", draft_tree=True, num_draft_tokens=3)
    want = [o.token_ids for o in LLM(**kw).generate(prompts, sp)]
    off = LLM(**kw, offload="disk", repack_dir=str(tmp_path / "r"), cache_experts=10, cache_policy="lru")
    assert [o.token_ids for o in off.generate(prompts, sp)] == want
    s = off.stats
    assert s["expert_bytes_per_token"] > 0 and s["draft_phase_bytes"] == 0 and s["tree_sibling_nodes"] > 0


def test_tree_accepts_off_chain_paths_and_compacts_their_kv(ar_llm):
    """Batch 7: some accepted path leaves the first (chain) branch, so its K/V was moved; afterwards every
    slot's cache equals what plain decoding wrote over the committed positions."""
    prompts, sp = BATCHES[7]
    llm = tree_llm(num_draft_tokens=4, draft_tree_width=4)
    outs = llm.generate(prompts, sp)
    assert llm.stats["tree_kv_rows_moved"] > 0, "an accepted path must have left the chain branch"
    ar_outs = ar_llm.generate(prompts, sp)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ar_outs]
    for b, o in enumerate(outs):  # one slot per request, in order; the last emitted token was never written
        n = len(o.prompt_token_ids) + len(o.token_ids) - 1
        for mine, ref in ((llm._cache.k, ar_llm._cache.k), (llm._cache.v, ar_llm._cache.v)):
            torch.testing.assert_close(mine[:, b, :, :n], ref[:, b, :, :n], rtol=1e-4, atol=1e-5)  # [L, B, H, S, D]


@pytest.mark.parametrize("family", ["gpt_oss", "deepseek_v3"])
def test_tree_greedy_equals_ar_with_sinks_windows_and_mla(tiny_ckpt, family):
    """GPT-OSS (sinks, sliding window 3 on two layers) and DeepSeek-V3 (MLA) go through the same tree mask."""
    path = tiny_ckpt(family)
    r = random.Random(5)
    motif = [r.randrange(96) for _ in range(5)]
    prompts = [(motif * 4)[:12 + k] + [r.randrange(96) for _ in range(k)] for k in range(6)]
    sps = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (24, 7, 16, 30, 2, 20)]
    ref = [o.token_ids for o in LLM(path, dtype="float32").generate(prompts, sps)]
    llm = tree_llm(path, num_draft_tokens=4, draft_tree_width=3)
    assert [o.token_ids for o in llm.generate(prompts, sps)] == ref
    s = llm.stats
    assert s["tree_branched_rows"] > 0 and s["accepted_tokens"] > 0 and s["tree_nodes_rejected"] > 0, s


def test_seeded_tree_rows_equal_plain_seeded_decoding(tiny_ckpt):
    path = tiny_ckpt("mixtral")
    prompts = [[7, 8, 9, 7, 8, 9, 7, 8], [1, 2, 3, 4, 1, 2, 3], [5, 5, 5, 5]]
    sps = [SamplingParams(max_tokens=20, temperature=0.7, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    sps.append(SamplingParams(max_tokens=12, ignore_eos=True))
    prompts.append([9, 9, 1, 9, 9])
    ref = [o.token_ids for o in LLM(path, dtype="float32").generate(prompts, sps)]
    for drafter in ("ngram", "self"):
        llm = tree_llm(path, num_draft_tokens=3, draft_tree_width=3, drafter=drafter, draft_experts=2)
        assert [o.token_ids for o in llm.generate(prompts, sps)] == ref, drafter
        assert llm.stats["tree_nodes_verified"] > 0 and llm.stats["accepted_tokens"] > 0


def test_tree_offloaded_equals_resident(tmp_path):
    prompts, sp = BATCHES[7]
    res = tree_llm(num_draft_tokens=4, draft_tree_width=3)
    want = [o.token_ids for o in res.generate(prompts, sp)]
    off = tree_llm(num_draft_tokens=4, draft_tree_width=3, offload="disk", repack_dir=str(tmp_path / "r"),
                   cache_experts=8, cache_policy="lru")
    assert [o.token_ids for o in off.generate(prompts, sp)] == want
    s = off.stats
    assert s["expert_bytes_per_token"] > 0 and s["draft_phase_bytes"] == 0 and s["tree_branched_rows"] > 0


def _logprobs(llm, prompt, sp):
    from specmoe.engine.core import Request
    with llm.engine() as core:
        req = core.add(Request(prompt_ids=prompt, params=sp, logprobs=2))
        while not req.finished:
            core.step()
    return req.output_ids, req.token_logprobs


def test_tree_logprobs_follow_the_accepted_path(ar_llm):
    """With logprobs, each emitted token is scored by its own path node's row (the rows are reordered)."""
    prompt = ar_llm.tokenizer.encode(code_prompts(1)[0])
    sp = SamplingParams(max_tokens=30, ignore_eos=True)
    llm = tree_llm(num_draft_tokens=4, draft_tree_width=4)
    ids, lps = _logprobs(llm, prompt, sp)
    ref_ids, ref_lps = _logprobs(ar_llm, prompt, sp)
    assert ids == ref_ids and llm.stats["tree_branched_rows"] > 0
    assert len(lps) == len(ref_lps) == len(ids)
    for a, b in zip(lps, ref_lps):
        assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]


def ref_mask(parents_per_row, starts, depths, S, window):
    B, T = depths.shape
    m = torch.zeros(B, T, S, dtype=torch.bool)
    for b in range(B):
        par = parents_per_row[b]
        for t in range(T):
            anc, u = {t}, t
            while u > 0 and u - 1 < len(par):
                u = par[u - 1] + 1
                anc.add(u)
            pos_t = starts[b] + depths[b, t].item()
            for j in range(S):
                if j < starts[b]:
                    ok, kp = True, j
                elif j - starts[b] in anc and j - starts[b] < T:
                    ok, kp = True, starts[b] + depths[b, j - starts[b]].item()
                else:
                    ok, kp = False, 0
                if ok and window:
                    ok = kp > pos_t - window
                m[b, t, j] = ok
    return m[:, None]


@pytest.mark.parametrize("window", [None, 2, 3])
def test_tree_attention_mask_matches_a_brute_force_reference(window):
    from specmoe.decoding.trees.tree import DraftTree, ancestor_mask
    trees = [DraftTree([1, 2, 3, 4, 5], [-1, 0, -1, 2, 0]), DraftTree([6, 7], [-1, 0]), DraftTree([], [])]
    starts, T = [4, 2, 6], 6
    depths = torch.tensor([[0] + t.depths() + [0] * (T - 1 - len(t)) for t in trees])
    wp = torch.tensor(starts)[:, None] + torch.arange(T)[None, :]
    bv = BatchView(slots=torch.arange(3), positions=torch.tensor(starts)[:, None] + depths,
                   key_len=max(starts) + T, tree=torch.tensor([ancestor_mask(t, T) for t in trees]),
                   write_positions=wp)
    got = tree_attention_mask(bv, window)
    want = ref_mask([t.parents for t in trees], starts, depths, bv.key_len, window)
    # padding rows (past a tree) are free to see what they like; compare the real rows
    for b, t in enumerate(trees):
        assert torch.equal(got[b, :, :len(t) + 1], want[b, :, :len(t) + 1]), (b, window)


def test_tree_options_are_checked():
    with pytest.raises(InputError):
        LLM(decoding="ar", draft_tree=True)  # nothing is drafted
    with pytest.raises(InputError):
        LLM(decoding="specmoe", drafter="ngram", draft_tree="yes")
    with pytest.raises(InputError):
        LLM(decoding="specmoe", drafter="ngram", draft_tree=True, draft_tree_width=0)


def test_cli_has_the_draft_tree_flags():
    import argparse

    from specmoe.cli.common import add_option_args
    p = argparse.ArgumentParser()
    add_option_args(p)
    a = p.parse_args(["--draft-tree", "--draft-tree-width", "2"])
    assert a.opt__draft_tree is True and a.opt__draft_tree_width == 2
    assert code_prompts(1)
