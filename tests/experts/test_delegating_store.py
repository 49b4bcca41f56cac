"""A wrapped store is still a store: `DelegatingStore` forwards every member the `ExpertStore` contract declares,
and every decoding strategy (ar, specmoe, auto; drafters self / ngram / eagle; token trees) runs through a
delegating wrapper installed before the engine's first generate (so `decoding="auto"` calibrates through it, as
when the bench's `measure` times an engine's first run) with the unwrapped engine's greedy output."""
from __future__ import annotations

import pytest

from specmoe import LLM, SamplingParams
from specmoe.bench.measure import TimedStore, measure
from specmoe.experts.store import ClosedStore, DelegatingStore, ExpertStore
from tests.decoding.eagle_cases import prompts

# a small cache over the disk tier: fetches read, `auto` calibrates its read time through the wrapper
OFFLOAD = dict(offload="disk", cache_experts=8)
SP = SamplingParams(max_tokens=12, ignore_eos=True)

STRATEGIES = {
    "ar": dict(decoding="ar"),
    "specmoe-self": dict(decoding="specmoe"),
    "specmoe-ngram": dict(decoding="specmoe", drafter="ngram"),
    "specmoe-eagle": dict(decoding="specmoe", drafter="eagle"),
    "tree-self": dict(decoding="specmoe", draft_tree=True),
    "tree-ngram": dict(decoding="specmoe", drafter="ngram", draft_tree=True),
    "tree-eagle": dict(decoding="specmoe", drafter="eagle", draft_tree=True),
    "auto": dict(decoding="auto"),
}


def contract_members() -> set[str]:
    """Public names `ExpertStore` declares: methods, properties and annotated attributes."""
    names = set()
    for cls in ExpertStore.__mro__:
        if cls is object:
            continue
        names |= {n for n in vars(cls) if not n.startswith("_")}
        names |= {n for n in getattr(cls, "__annotations__", {}) if not n.startswith("_")}
    return names


def test_delegating_store_overrides_every_contract_member():
    missing = sorted(n for n in contract_members() if n not in vars(DelegatingStore))
    assert not missing, f"DelegatingStore does not forward {missing}"
    assert {"device", "holds_all", "forward_observers", "forward_layer_hooks", "bytes_moved",
            "fetch_wait_s", "lookups"} <= contract_members()


def test_closed_store_refuses_every_attribute():
    from specmoe.errors import InputError
    c = ClosedStore("x")
    with pytest.raises(InputError, match="closed"):
        c.device  # noqa: B018


class Wrapped(DelegatingStore):
    """A wrapper that changes nothing but counts fetch calls."""

    def __init__(self, inner):
        super().__init__(inner)
        self.fetches = 0

    def fetch(self, layer, routing):
        self.fetches += 1
        return self.inner.fetch(layer, routing)


@pytest.fixture(scope="module")
def reference():
    """(prompt ids, greedy tokens) of the unwrapped, all-resident engine."""
    outs = LLM(dtype="float32", threads=1).generate(prompts(3), SP)
    return [o.prompt_token_ids for o in outs], [o.token_ids for o in outs]


@pytest.mark.parametrize("name", list(STRATEGIES))
def test_every_strategy_runs_through_a_delegating_store(name, reference, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # `auto` calibrates now, through the wrapper
    llm = LLM(dtype="float32", threads=1, **OFFLOAD, **STRATEGIES[name])
    inner = llm.store
    llm.store = w = Wrapped(inner)
    got = [o.token_ids for o in llm.generate(prompts(3), SP)]
    assert got == reference[1]
    assert w.fetches > 0
    assert w.device == inner.device and w.holds_all == inner.holds_all
    assert w.stats() == inner.stats()


def test_auto_first_generate_inside_measure(tmp_path, monkeypatch, reference):
    """The bench's `measure` wraps the store in its `TimedStore` around an `auto` engine's first generate:
    calibration reads experts through it."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    llm = LLM(dtype="float32", threads=1, decoding="auto", **OFFLOAD)
    inner = llm.store
    row = measure(llm, reference[0], SP.max_tokens, instrument=True)
    assert row["_token_ids"] == reference[1]
    assert row["breakdown"]["store_calls"] > 0
    assert llm.store is inner and not isinstance(inner, TimedStore)
    assert any((tmp_path / "specmoe" / "costmodel").glob("*.json")), "calibrated now, not from a cached file"
