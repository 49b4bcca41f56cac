"""Background expert loads for the expert cache: I/O threads that read experts from the backing tier into slot
rows while the compute thread works on what is already resident. One thread (one queue, like one link), or on
CPU as many as the tier serves reads at once (`Tier.queue_depth`: the disk tier's `io_depth`), each taking
every n-th queued load.

The cache queues loads (`submit`) and hands the queue over as one job per layer (`flush`: one thread wake-up per
layer instead of one per expert); `wait` blocks on one load and returns the seconds waited. On CPU the tier
reads straight into the slot row and the waiting compute thread verifies the bytes (overlapped with the next
read). On CUDA the read lands in pinned staging rows (disk, or a decoding host tier), is verified there, and is
copied to the device on a dedicated stream after the compute that last read the destination is done (`after`);
the compute stream then waits only for that copy's event.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from specmoe.experts.budget import STAGING_BUFFERS
from specmoe.experts.tiers import Tier
from specmoe.memory import aligned_empty


class ExpertLoader:
    def __init__(self, tier: Tier, device: torch.device, slot_bytes: int):
        self.tier, self.device, self.slot_bytes = tier, device, slot_bytes
        self.expert_bytes = tier.expert_bytes
        self.cuda = device.type == "cuda"
        # CUDA: reads that are not a plain host copy (disk, or a decoding tier) land in pinned staging rows
        self.host_copy = tier.kind == "host" and tier.identity
        self.staging_bytes = STAGING_BUFFERS * slot_bytes if self.cuda and not self.host_copy else 0
        self._queue: list = []  # loads not yet handed to the I/O threads
        # CPU: one thread per read the tier serves at once; CUDA: one (the staging ring and the copy stream)
        self.workers = 1 if self.cuda else tier.queue_depth
        self.io = ThreadPoolExecutor(max_workers=self.workers, thread_name_prefix="specmoe-io")
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(device)
            self._staging = [[aligned_empty(slot_bytes, pin=True), None]
                             for _ in range(self.staging_bytes // slot_bytes)]  # disk reads land here
            self._stage_i = 0

    def submit(self, layer: int, e: int, dst: torch.Tensor, after=None) -> Future:
        """Queue one load of expert e of `layer` into the row `dst` (CUDA: after the event `after`)."""
        fut = Future()
        fut.load = (layer, e, dst)  # what the cache forgets if the load fails
        self._queue.append((layer, e, dst, after, fut))
        return fut

    def flush(self) -> None:
        """Hand the queued loads to the I/O threads: dealt round-robin into one job per thread, so the first
        loads queued are the first read."""
        if self._queue:
            items, self._queue = self._queue, []
            for k in range(min(self.workers, len(items))):
                self.io.submit(self._run, items[k::self.workers])

    def _run(self, items) -> None:
        for layer, e, dst, after, fut in items:
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                # on CPU the waiting compute thread verifies (`wait`), overlapped with the next read here;
                # on CUDA the staging buffer is verified here, before its copy to the device
                fut.set_result(self._cuda_load(layer, e, dst, after) if self.cuda
                               else self.tier.read_into(layer, e, dst, verify=False))
            except BaseException as exc:  # handed to the waiting compute thread, which re-raises it
                fut.set_exception(exc)

    def _cuda_load(self, layer: int, e: int, dst: torch.Tensor, after):
        """Runs on the I/O thread: stage (disk) and copy on the dedicated stream; returns its event."""
        with torch.cuda.stream(self.copy_stream):
            if self.host_copy:
                src = self.tier.source(layer, e).view(torch.uint8)  # pinned
            else:
                stage = self._staging[self._stage_i]
                self._stage_i = (self._stage_i + 1) % len(self._staging)
                if stage[1] is not None:
                    stage[1].synchronize()  # the previous copy out of this staging buffer is done
                self.tier.read_into(layer, e, stage[0])
                src = stage[0]
            self.copy_stream.wait_event(after)  # compute no longer reads what dst held
            dst[: self.expert_bytes].copy_(src[: self.expert_bytes], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.copy_stream)
            if not self.host_copy:
                stage[1] = ev
        return ev

    def wait(self, fut: Future) -> float:
        """Block until the load is done (and verified); returns the seconds waited. Raises what the load raised."""
        self.flush()
        t0 = time.perf_counter()
        ev = fut.result()
        if not self.cuda:
            self.tier.verify(*fut.load)
        if ev is not None:  # CUDA: compute waits only on this expert's copy
            torch.cuda.current_stream(self.device).wait_event(ev)
        return time.perf_counter() - t0

    def close(self, wait: bool = True) -> None:
        """Stop the I/O thread (queued loads are cancelled) and drop the staging rows."""
        self.io.shutdown(wait=wait, cancel_futures=True)
        self._queue = []
        if self.cuda:
            self._staging = []
