"""Host rows that expert reads land in (cache slots, scratch, the disk tier's staging) sit in one mapping of their
own on transparent huge pages: aligned, zeroed, alive as long as a view is, reported in the stats, and reads into
them give the same experts and the same logits as rows from the allocator."""
from __future__ import annotations

import gc

import pytest
import torch

from specmoe import LLM, memory
from specmoe.memory import ALIGN, HUGE, aligned_empty, huge_backed_bytes, huge_pages_mode

THP = huge_pages_mode() in ("always", "madvise")
ADVISED_ONLY = huge_pages_mode() != "always"  # ("always": allocator memory may sit on huge pages too)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]


def test_large_buffers_get_a_huge_page_mapping_and_small_ones_do_not():
    big = aligned_empty(HUGE + 3 * ALIGN)
    assert big.data_ptr() % HUGE == 0 and big.numel() == HUGE + 3 * ALIGN
    assert int(big.count_nonzero()) == 0  # zeroed (faulted in) when allocated
    small = aligned_empty(HUGE // 2)
    assert small.data_ptr() % ALIGN == 0 and small.numel() == HUGE // 2
    off = aligned_empty(HUGE, huge=False)
    assert off.data_ptr() % ALIGN == 0
    if THP:
        assert huge_backed_bytes([big]) >= HUGE  # the kernel gave the mapping huge pages
    off.fill_(1)
    if ADVISED_ONLY:
        assert huge_backed_bytes([small, off]) == 0  # allocator memory: not advised, not counted
    assert huge_backed_bytes([]) == 0


@pytest.mark.skipif(not THP, reason="transparent huge pages are off on this machine")
def test_each_buffer_counts_only_its_own_huge_pages():
    """Mappings made one after the other never merge into one (which would count a neighbour's pages)."""
    bufs = [aligned_empty(3 * HUGE) for _ in range(4)]
    for b in bufs:
        assert HUGE <= huge_backed_bytes([b]) <= 3 * HUGE
    assert huge_backed_bytes(bufs) == sum(huge_backed_bytes([b]) for b in bufs)


def test_a_view_keeps_the_mapping_alive():
    big = aligned_empty(2 * HUGE)
    big.fill_(7)
    tail = big[HUGE:]
    del big
    gc.collect()
    assert int(tail.sum()) == 7 * HUGE


def test_without_madvise_it_falls_back_to_the_allocator(monkeypatch):
    monkeypatch.delattr(memory.mmap, "MADV_HUGEPAGE", raising=False)
    buf = aligned_empty(2 * HUGE)
    assert buf.data_ptr() % ALIGN == 0 and buf.numel() == 2 * HUGE
    buf.fill_(1)
    if ADVISED_ONLY:
        assert huge_backed_bytes([buf]) == 0


def test_engine_rows_on_huge_pages_give_the_same_logits_as_allocator_rows(monkeypatch):
    """The bundled demo model on the disk tier (its rows pass a huge page): the same logits as resident experts,
    with rows on huge pages and, as the control, with rows from the allocator; the stats say how many row bytes
    sit on huge pages."""
    ref = LLM(None, threads=1).logits(PROMPTS)
    llm = LLM(None, threads=1, offload="disk", cache_experts=4, cache_policy="lru")
    assert torch.equal(llm.logits(PROMPTS), ref)
    s = llm.stats
    assert s["misses"] > 0 and s["io_reads"] >= s["misses"]
    assert s["host_rows_bytes"] >= s["cache_bytes"] >= HUGE
    if THP:
        assert s["host_rows_huge_bytes"] >= HUGE
    monkeypatch.setattr(memory, "_huge_mapping", lambda nbytes: None)  # the control: rows from the allocator
    plain = LLM(None, threads=1, offload="disk", cache_experts=4, cache_policy="lru")
    if ADVISED_ONLY:
        assert plain.stats["host_rows_huge_bytes"] == 0
    assert torch.equal(plain.logits(PROMPTS), ref)
