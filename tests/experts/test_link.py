"""The host tier's emulated link paces transfers without holding the interpreter: a compute thread
running next to a stream of emulated transfers is not slowed down (a busy-wait slowed it ~20x)."""
from __future__ import annotations

import statistics
import threading
import time

import torch

from specmoe.experts.tiers import EmulatedLink, HostTier
from specmoe.weights.checkpoint import Checkpoint


def _compute(n: int = 25000) -> float:
    """Interpreter-bound work like a decode step's op dispatch (many small ops); returns its wall seconds."""
    a = torch.zeros(8)
    t0 = time.perf_counter()
    for _ in range(n):
        a.add_(1.0)
    return time.perf_counter() - t0


def test_emulated_transfers_do_not_slow_the_compute_thread(tiny_ckpt):
    ck = Checkpoint(tiny_ckpt("qwen3_moe"))
    link = EmulatedLink(gbps=0.02, latency_us=4500.0)  # ~5 ms per transfer of this tiny expert
    tier = HostTier(ck, torch.float32, pin=False, link=link)
    dst = torch.empty(tier.stride, dtype=torch.uint8)
    layer = ck.config.moe_layers[0]
    reads, io_cpu = [0], [0.0]

    def transfers(stop):
        c0 = time.thread_time()
        while not stop.is_set():
            tier.read_into(layer, 0, dst)
            reads[0] += 1
        io_cpu[0] += time.thread_time() - c0

    def measure() -> tuple[float, float]:
        """(CPU share of the pacing thread, median wall-time ratio of the compute work with / without)."""
        alone, loaded, cpu0 = [], [], io_cpu[0]
        for _ in range(9):  # interleaved pairs: alone, then with transfers running
            alone.append(_compute())
            stop = threading.Event()
            io = threading.Thread(target=transfers, args=(stop,))
            n0 = reads[0]
            io.start()
            time.sleep(0.003)  # transfers are under way
            loaded.append(_compute())
            stop.set()
            io.join()
            assert reads[0] > n0, "the transfers ran while the compute thread worked"
        return (io_cpu[0] - cpu0) / sum(loaded), statistics.median(b / a for a, b in zip(alone, loaded))

    _compute()  # warm up
    # The thread pacing the transfers uses the CPU (and so the interpreter) for at most 10% of the time the
    # compute thread worked next to it (measured 5-7% on a 2-core machine: the wake-ups themselves; a
    # busy-waiting link: 19% at these ~5 ms transfers, ~100% at shorter ones); thread CPU time hardly depends on what else runs. The compute thread's wall time barely
    # moves (median over pairs; generous for a noisy shared machine: the busy-wait made it many times slower).
    # A neighbour's burst can still spoil one measurement: it is repeated (up to 3 times) before failing.
    results = []
    for _ in range(3):
        results.append(measure())
        if results[-1][0] <= 0.10 and results[-1][1] <= 2.0:
            break
    share, ratio = results[-1]
    assert reads[0] >= 5 * 9 * len(results)
    assert share <= 0.10, f"the emulated link used {share:.0%} of a CPU while pacing transfers ({results})"
    assert ratio <= 2.0, f"compute thread {ratio:.2f}x slower during emulated transfers ({results})"
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
