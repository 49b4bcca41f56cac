"""Engine lifetime: close() / `with LLM(...)` release the disk tier's file, the I/O thread and the
buffers at once (not when the garbage collector gets to them), and a closed engine says so."""
from __future__ import annotations

import gc
import os
import threading
import weakref

import pytest

from specmoe import LLM, SamplingParams
from specmoe.errors import InputError

ONE = SamplingParams(max_tokens=1)


def open_fds() -> set[tuple[str, str]]:
    """(fd, what it points to) of this process (the fd of the listing itself is gone by the readlink)."""
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add((fd, os.readlink(f"/proc/self/fd/{fd}")))
        except FileNotFoundError:
            pass
    return out


def io_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("specmoe-io")]


def test_close_releases_file_thread_and_buffers_at_once(tiny_ckpt):
    path = tiny_ckpt("mixtral")
    llm = LLM(path, offload="disk", cache_experts=2)
    llm.generate([[1, 2, 3]], ONE)
    tier, cache = llm.provider.tier, llm.provider
    fd = (str(tier.fd), str(tier.rp.file))
    assert fd in open_fds() and io_threads()
    rows = [weakref.ref(L.rows) for L in cache.layers.values()]
    llm.close()  # llm and its provider are still referenced: nothing here is the garbage collector's doing
    assert fd not in open_fds() and not any(t == str(tier.rp.file) for _, t in open_fds())
    assert tier.fd == -1 and not io_threads()
    assert all(r() is None for r in rows)  # the slots are freed
    llm.close()  # idempotent
    for use in (lambda: llm.generate([[1, 2, 3]], ONE), lambda: llm.logits([[1, 2]]), lambda: llm.stats,
                lambda: cache.fetch(1, [0]).__next__()):
        with pytest.raises(InputError, match="closed"):
            use()


def test_with_statement_closes_host_tier(tiny_ckpt):
    with LLM(tiny_ckpt("qwen3_moe"), offload="host", cache_experts=2) as llm:
        out = llm.generate([[4, 5, 6]], ONE)
        tier = llm.provider.tier
        host = [weakref.ref(t) for t in tier.layers.values()]
    assert len(out[0].token_ids) == 1
    assert not io_threads() and all(r() is None for r in host)  # host copies (pinned on CUDA) dropped
    with pytest.raises(InputError, match="closed"):
        llm.generate([[4, 5, 6]], ONE)


def test_fifty_engines_leave_no_fd_or_thread(tiny_ckpt):
    path = tiny_ckpt("olmoe")
    LLM(path, offload="disk", cache_experts=2).close()  # repack and first-use imports happen once, before
    gc.collect()
    fds, threads = open_fds(), threading.active_count()
    kept = []
    for _ in range(50):
        llm = LLM(path, offload="disk", cache_experts=2)
        llm.generate([[1, 2, 3]], ONE)
        llm.close()
        kept.append(llm)  # still referenced: close() alone must have released everything
        assert threading.active_count() == threads
    assert open_fds() == fds and threading.active_count() == threads
    del kept, llm
    gc.collect()
    assert open_fds() == fds and threading.active_count() == threads
