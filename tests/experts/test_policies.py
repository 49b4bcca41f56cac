"""Cache policies as objects (experts/policies.py): each one's victim and what it keeps after a forward."""
import pytest
import torch

from specmoe.experts.policies import POLICIES, CachePolicy, LayerSlots, make_policy


def slots_with(resident: list[int], freq: dict[int, int]) -> LayerSlots:
    L = LayerSlots(torch.zeros(len(resident) + 1, 8, dtype=torch.uint8), 8, ())
    for s, e in enumerate(resident):  # resident in this order: the first is the least recently used
        L.slot_of[e] = s
        L.recency[e] = None
    for e, n in freq.items():
        L.freq[e] = n
    return L


def test_every_policy_is_a_declared_policy_object():
    assert POLICIES == ("ondemand", "static", "lru", "lfu")
    assert all(isinstance(make_policy(p), CachePolicy) and make_policy(p).name == p for p in POLICIES)


def test_lru_and_lfu_victims():
    L = slots_with([3, 1, 5], {3: 4, 1: 1, 5: 2})
    assert make_policy("lru").victim(L, keep=set()) == 3  # oldest
    assert make_policy("lfu").victim(L, keep=set()) == 1  # least frequent
    L.pinned = {1}
    assert make_policy("lfu").victim(L, keep={5}) == 3  # pinned and kept experts are never a victim
    L.static = {3}
    assert make_policy("lru").victim(L, keep={5}) is None


def test_touch_counts_and_refreshes_recency():
    L = slots_with([3, 1, 5], {})
    make_policy("lru").touch(L, [3])
    assert list(L.recency) == [1, 5, 3] and L.freq[3] == 1
    assert make_policy("lru").victim(L, keep=set()) == 1


@pytest.mark.parametrize("name,kept", [("ondemand", {2}), ("static", {2, 4}), ("lru", {2, 4, 6}), ("lfu", {2, 4, 6})])
def test_what_stays_after_a_forward(name, kept):
    L = slots_with([2, 4, 6], {})
    L.pinned, L.static = {2}, ({4} if name == "static" else set())
    if name == "ondemand":
        L.prefetched = set()
    gone = make_policy(name).after_forward(L)
    assert set(L.slot_of) - set(gone) == kept
