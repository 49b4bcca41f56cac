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
    assert POLICIES == ("ondemand", "static", "lru", "lfu", "adaptive", "s3fifo")
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


def _stream(policy: str, requests: list[list[int]], slots: int = 3) -> tuple[int, LayerSlots]:
    """Run `requests` through one layer's slots under `policy` (the cache's order: victims, then touch); hits."""
    p = make_policy(policy)
    L = LayerSlots(torch.zeros(slots, 8, dtype=torch.uint8), 16, ())
    hits = 0
    for ids in requests:
        hits += sum(e in L.slot_of for e in ids)
        for e in ids:
            if e in L.slot_of:
                continue
            if L.free:
                s = L.free.pop()
            else:
                v = p.victim(L, set(ids))
                L.recency.pop(v)
                s = L.slot_of.pop(v)
            L.slot_of[e] = s
            L.recency[e] = None
        p.touch(L, ids)
    return hits, L


# a skewed stream (expert 0 every 4th forward, pairs from a pool of 15 between): LFU keeps 0, LRU lets the pairs
# push it out; a drifting stream (each phase cycles a new set of 3): LRU follows the phase, LFU clings to the
# last phase's counts
SKEWED = [[0] if i % 4 == 0 else [1 + (2 * i) % 15, 1 + (2 * i + 1) % 15] for i in range(200)]
DRIFTING = [[(i // 40) * 3 + i % 3] for i in range(200)]


@pytest.mark.parametrize("stream,winner", [(SKEWED, "lfu"), (DRIFTING, "lru")])
def test_adaptive_follows_the_rule_that_hits_more(stream, winner):
    loser = {"lru": "lfu", "lfu": "lru"}[winner]
    hits = {name: _stream(name, stream)[0] for name in ("lru", "lfu")}
    assert hits[winner] > 1.2 * hits[loser]  # the streams do separate the two rules
    got, L = _stream("adaptive", stream)
    assert L.ghosts.rule == winner  # it switched to (or stayed on) the rule that wins here
    assert got >= 0.9 * hits[winner] and got > hits[loser]
    st = make_policy("adaptive").stats([L])
    assert st["adaptive_rule_per_layer"] == [winner] and st["adaptive_ghost_hit_rate"][winner] > 0
