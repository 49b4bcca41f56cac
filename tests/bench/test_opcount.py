"""The op / host-sync counter behind benchmarks/ops_count.py, and the step's sync budget it measures."""
from __future__ import annotations

import pytest
import torch

import specmoe.engine.llm as llm_mod
from specmoe import LLM, SamplingParams
from specmoe.bench.opcount import OpCounter


def test_counter_counts_ops_and_each_kind_of_host_sync():
    x = torch.arange(6.0)
    with OpCounter() as c:
        y = (x * 2 + 1).sum()
    assert c.ops >= 3 and c.syncs == 0 and c.by_op["aten::mul"] == 1
    with OpCounter() as c:
        y.item()
        x.tolist()
        x.nonzero()
    assert c.syncs == 3 and set(c.sync_sites) == {"aten::_local_scalar_dense", "tolist", "aten::nonzero"}
    assert x.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0], "tolist is restored on exit"


def _step_counts(path, decoding: str, steps: int = 3) -> list[OpCounter]:
    """Counters of the decode steps (after the first, which sets the draft up) of a batch-1 generate."""
    seen: list[OpCounter] = []
    make = llm_mod.make_strategy

    def counted_strategy(*a, **kw):
        strategy = make(*a, **kw)
        step = strategy.step

        def counted(active):
            with OpCounter() as c:
                out = step(active)
            seen.append(c)
            return out
        strategy.step = counted
        return strategy
    llm_mod.make_strategy = counted_strategy
    try:
        LLM(path, decoding=decoding, num_draft_tokens=3, draft_experts=4).generate(
            [[5, 6, 7, 8]], SamplingParams(max_tokens=4 * (steps + 2), ignore_eos=True))
    finally:
        llm_mod.make_strategy = make
    assert len(seen) > steps
    return seen[1:steps + 1]


@pytest.mark.parametrize("decoding,syncs", [("ar", 1), ("specmoe", 2)])
def test_resident_decode_step_host_syncs(tiny_ckpt, decoding, syncs):
    """A resident decode step at batch 1 reads the host once (AR: the sampled tokens) or twice (SpecMoE: the
    acceptance, the draft-set counts of the verification): no host read per layer or per draft position."""
    path = tiny_ckpt("qwen3_moe")
    for c in _step_counts(path, decoding):
        assert c.ops > 0
        assert c.syncs == syncs, dict(c.sync_sites)
