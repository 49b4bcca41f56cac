"""The host tier's emulated link paces transfers without holding the interpreter: a compute thread
running next to a stream of emulated transfers is not slowed down (a busy-wait slowed it ~20x)."""
from __future__ import annotations

import statistics
import threading
import time

import torch

from specmoe.experts.tiers import EmulatedLink, HostTier
from specmoe.weights.checkpoint import Checkpoint


def _compute(n: int = 12000) -> float:
    """Interpreter-bound work like a decode step's op dispatch (many small ops); returns its wall seconds."""
    a = torch.zeros(8)
    t0 = time.perf_counter()
    for _ in range(n):
        a.add_(1.0)
    return time.perf_counter() - t0


def test_emulated_transfers_do_not_slow_the_compute_thread(tiny_ckpt):
    ck = Checkpoint(tiny_ckpt("qwen3_moe"))
    link = EmulatedLink(gbps=0.01, latency_us=4000.0)  # ~5 ms per transfer of this tiny expert
    tier = HostTier(ck, torch.float32, pin=False, link=link)
    dst = torch.empty(tier.stride, dtype=torch.uint8)
    layer = ck.config.moe_layers[0]
    reads = [0]

    def transfers(stop):
        while not stop.is_set():
            tier.read_into(layer, 0, dst)
            reads[0] += 1

    def slowdown(reps: int = 9) -> float:
        """Median over interleaved pairs of (wall time of the compute work with transfers running / without):
        robust to other load on a small shared machine."""
        alone, loaded = [], []
        for _ in range(reps):
            alone.append(_compute())
            stop = threading.Event()
            io = threading.Thread(target=transfers, args=(stop,))
            n0 = reads[0]
            io.start()
            time.sleep(0.005)  # transfers are under way
            loaded.append(_compute())
            stop.set()
            io.join()
            assert reads[0] - n0 >= 3, "the transfers ran while the compute thread worked"
        return statistics.median(b / a for a, b in zip(alone, loaded))

    _compute()  # warm up
    # a busy-waiting link makes this ~20x; a noisy neighbour can add a few percent to one measurement,
    # so the measurement is repeated (up to 3 times) before it counts as a failure
    ratios = []
    for _ in range(3):
        ratios.append(slowdown())
        if ratios[-1] <= 1.05:
            break
    assert min(ratios) <= 1.05, f"compute thread {min(ratios):.2f}x slower during emulated transfers ({ratios})"
    # the link still holds each transfer for its full duration, and spins at most a few microseconds
    assert link.held_s >= reads[0] * link.duration(tier.expert_bytes) * 0.99
    assert link.spin_s <= reads[0] * link.SPIN_MAX_S * 1.5 + 1e-3


def test_link_holds_until_the_deadline():
    link = EmulatedLink(gbps=1.0, latency_us=0.0)
    for nbytes in (100_000, 1_000_000, 3_000_000):  # 0.1, 1, 3 ms
        t0 = time.perf_counter()
        link.hold(nbytes, t0)
        took = time.perf_counter() - t0
        assert took >= nbytes / 1e9
