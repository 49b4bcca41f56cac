"""Backing tiers: where an expert's bytes live when they are not in a device slot.

A tier holds every expert in its *storage format* (experts/formats.py: the checkpoint's dtype, or int8 /
int4 made by `specmoe quantize`) and fills a slot with the *compute dtype*: one transfer of the stored
bytes, decoded (upcast or dequantised) on arrival. `bytes_moved` counts stored bytes.
- `HostTier`: every expert's stored bytes in host RAM ([E, stored bytes] per layer, pinned when the
  compute device is CUDA), optionally behind an *emulated link* that throttles each transfer to
  latency + stored bytes / bandwidth (labelled as emulation in every stats dict);
- `DiskTier`: experts read on demand from the aligned repack file (see repack.py) with one `preadv`
  per expert, through `O_DIRECT` so the page cache is bypassed and the read really hits the SSD; every
  read is verified against the expert's checksum (integrity.py). A read lands in an aligned staging row
  of the tier, is verified there, and is decoded (or copied) into the slot, on the I/O thread or, for up
  to STAGE_ROWS reads at a time, by `verify` on the compute thread while the I/O thread reads the next
  expert (the cache calls it before using a slot): O_DIRECT reads straight into
  the CPU slots the model computes from slowed the whole compute thread 6-10x on the development
  machine (non-expert layers included; benchmarks/quant_bench.py's notes), while the extra copy costs
  about a memory pass. `direct=True` (CUDA: the destination is a pinned staging buffer) reads straight
  into the destination when no decode is needed. Where the filesystem refuses O_DIRECT it falls back,
  with a warning, to buffered reads followed by `posix_fadvise(DONTNEED)`.
"""
from __future__ import annotations

import errno
import os
import threading
import time
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from specmoe.errors import CheckpointError, IntegrityError
from specmoe.experts.formats import ExpertFormat, ExpertShape, Plain
from specmoe.experts.integrity import checksum
from specmoe.memory import aligned_empty, check_fits, round_up
from specmoe.experts.repack import Repacked, expert_bytes_of
from specmoe.weights.checkpoint import Checkpoint


class Tier(ABC):
    """A backing tier. Contract: `read_into(layer, e, dst, verify=)` fills `dst` (a uint8 CPU row of at least
    `stride` bytes) with expert e packed as [gate; up; down] in the compute `dtype` (`expert_bytes` bytes),
    from one transfer of its `stored_bytes` in the storage format `fmt`; `verify(layer, e, dst)` checks what
    a read left in `dst` (a no-op where there is nothing to check, or where the read verified the stored
    bytes itself before decoding them) and raises IntegrityError; `read_into(..., verify=False)` leaves
    that to the caller, which may run it on another thread, overlapped with the next read. `reads` /
    `read_s` / `verify_s` count reads and the seconds spent reading and verifying."""
    kind: str
    dtype: torch.dtype  # compute dtype: what a slot holds
    fmt: ExpertFormat  # storage format: what the tier holds and moves
    expert_bytes: int  # bytes of one expert in a slot (compute dtype)
    direct_io: bool = False
    queue_depth: int = 1  # reads the tier serves at once (the loader runs one I/O thread per read in flight)
    reads: int = 0
    read_s: float = 0.0
    verify_s: float = 0.0

    @property
    def stored_bytes(self) -> int:
        """Bytes one expert moves from this tier (its stored size)."""
        return self.fmt.stored_bytes

    @property
    def identity(self) -> bool:
        """The stored bytes are the slot's bytes: no decode on arrival."""
        return self.fmt.identity(self.dtype)

    @property
    def stride(self) -> int:
        """Bytes of one expert's slot row (the disk tier reads whole aligned strides into it)."""
        return round_up(self.expert_bytes, 64)

    @property
    def staging_bytes(self) -> int:
        """Host buffers of the tier's own that reads land in before a slot (0 where none)."""
        return 0

    @property
    def host_buffers(self) -> tuple[torch.Tensor, ...]:
        """Those buffers (CPU tensors; empty where none)."""
        return ()

    @abstractmethod
    def read_into(self, layer: int, e: int, dst: torch.Tensor, *, verify: bool = True) -> None:
        ...

    def verify(self, layer: int, e: int, dst: torch.Tensor) -> None:
        """Nothing to check by default (host RAM copies are not read from a medium)."""

    def reset_io_stats(self) -> None:
        self.reads, self.read_s, self.verify_s = 0, 0.0, 0.0

    def close(self) -> None:
        """Release files and buffers now."""


class EmulatedLink:
    """Holds each transfer to `latency_us + nbytes / (gbps·1e9)` seconds (GB/s = 10^9 bytes/s).
    Transfers are serialised, like one PCIe link.

    Pacing sleeps to the transfer's deadline, so the interpreter is free while a transfer is held and the
    compute thread runs undisturbed (a busy-wait held the GIL and slowed it ~20x). `time.sleep` wakes up a
    little late; the link learns that oversleep (a moving average) and sleeps that much less, and only the
    last few microseconds, if any are left, are spun. `held_s` / `spin_s` / `late_s` count the seconds
    transfers were held, spent spinning, and overshot their deadline."""

    SPIN_MAX_S = 20e-6  # never spin longer than this: a longer remainder is slept

    def __init__(self, gbps: float | None, latency_us: float | None):
        self.gbps, self.latency_us = gbps, latency_us or 0.0
        self.lock = threading.Lock()
        self.oversleep = 50e-6  # learned: how late time.sleep wakes up on this machine
        self.held_s = self.spin_s = self.late_s = 0.0

    def duration(self, nbytes: int) -> float:
        return self.latency_us * 1e-6 + (nbytes / (self.gbps * 1e9) if self.gbps else 0.0)

    def hold(self, nbytes: int, t0: float) -> None:
        """Return at t0 + duration(nbytes) (not before), without holding the GIL while waiting."""
        deadline = t0 + self.duration(nbytes)
        now = time.perf_counter()
        while deadline - now > self.SPIN_MAX_S:
            want = max(deadline - now - self.oversleep, 0.0)
            time.sleep(want)
            after = time.perf_counter()
            self.oversleep += 0.1 * ((after - now - want) - self.oversleep)
            now = after
        spin0 = now
        while now < deadline:
            now = time.perf_counter()
        self.spin_s += now - spin0
        self.late_s += max(0.0, now - deadline)
        self.held_s += now - t0


class HostTier(Tier):
    kind = "host"

    def __init__(self, ckpt: Checkpoint, dtype: torch.dtype, *, pin: bool, link: EmulatedLink | None = None,
                 budget: int | None = None, progress: bool = False, fmt: ExpertFormat | None = None,
                 reader: Callable[[int, int], torch.Tensor] | None = None):
        """`fmt`: the storage format (default: `dtype` itself); `reader(layer, e)`: an expert's stored bytes
        (default: encoded from the checkpoint; the factory passes the repack's reader for quantized
        formats)."""
        from tqdm import tqdm
        cfg = ckpt.config
        self.dtype, self.link = dtype, link
        self.fmt = fmt if fmt is not None else Plain(ExpertShape.of(cfg), dtype)
        self.numel = cfg.expert_numel
        self.expert_bytes = self.fmt.slot_bytes(dtype)
        read = reader or (lambda layer, e: torch.from_numpy(expert_bytes_of(ckpt, layer, e, self.fmt)))
        total = self.stored_bytes * cfg.num_experts * len(cfg.moe_layers)
        check_fits("the host expert tier (all experts in host RAM)", total, torch.device("cpu"), budget=budget)
        self.nbytes = total
        self.layers: dict[int, torch.Tensor] = {}
        bar = tqdm(total=len(cfg.moe_layers) * cfg.num_experts, desc="host experts", unit="exp",
                   disable=not progress, leave=False)
        for layer in cfg.moe_layers:
            buf = torch.empty(cfg.num_experts, self.stored_bytes, dtype=torch.uint8, pin_memory=pin)
            for e in range(cfg.num_experts):
                buf[e].copy_(read(layer, e))
                bar.update()
            self.layers[layer] = buf
        bar.close()

    def source(self, layer: int, e: int) -> torch.Tensor:
        """The expert's stored bytes in host RAM (pinned on CUDA), for an async device copy (identity only)."""
        return self.layers[layer][e]

    def read_into(self, layer: int, e: int, dst: torch.Tensor, *, verify: bool = True) -> None:
        """Decode into `dst`, a uint8 row of at least expert_bytes (CPU); the link is held for the stored bytes."""
        t0 = time.perf_counter()
        out = dst[: self.expert_bytes].view(self.dtype)
        if self.link is not None:
            with self.link.lock:
                self.fmt.load(self.layers[layer][e], out)
                self.link.hold(self.stored_bytes, t0)
        else:
            self.fmt.load(self.layers[layer][e], out)

    def close(self) -> None:
        self.layers = {}  # the (pinned) host copies go now, not when the engine is collected


class DiskTier(Tier):
    kind = "disk"
    STAGE_ROWS = 2  # reads whose decode the compute thread finishes while the next read runs

    def __init__(self, rp: Repacked, dtype: torch.dtype | None = None, *, direct: bool = False, queue_depth: int = 1):
        """`dtype`: the compute dtype slots hold (default: the repack's own); `direct`: read straight into the
        destination where no decode is needed (else through a staging row); `queue_depth`: reads that may run
        at once (on as many threads; each has its own staging rows)."""
        self.queue_depth = max(1, int(queue_depth))
        self.rp = rp
        self.fmt = rp.fmt
        self.dtype = dtype if dtype is not None else rp.fmt.dtype
        self.direct = direct and self.fmt.identity(self.dtype)
        self.numel = rp.expert_numel
        self.expert_bytes = self.fmt.slot_bytes(self.dtype)
        self.nbytes = 0
        self.direct_io = False
        self.fd = -1
        # staged reads, per read in flight: one row for reads finished on the I/O thread, STAGE_ROWS for reads
        # whose checksum and decode are left to `verify` (the compute thread, overlapped with the next reads)
        q = self.queue_depth
        n = 0 if self.direct else q * (1 + self.STAGE_ROWS)
        block = aligned_empty(n * rp.stride).view(n, rp.stride) if n else None  # one mapping (huge pages)
        self._stages = [block[i] for i in range(q)] if n else []
        self._free_stages = list(range(len(self._stages)))
        self._rows = [block[i] for i in range(q, n)] if n else []
        self._free = list(range(len(self._rows)))
        self._inflight = 0
        self._pending: dict[int, int] = {}  # destination address -> staging row awaiting `verify`
        self._lock = threading.Lock()
        if hasattr(os, "O_DIRECT"):
            fd = -1
            try:
                fd = os.open(rp.file, os.O_RDONLY | os.O_DIRECT)
                probe = aligned_empty(rp.stride, huge=False)  # one read, then dropped
                os.preadv(fd, [probe.numpy()], 0)  # some filesystems accept the flag but refuse the read
                self.fd, self.direct_io = fd, True
            except OSError as e:
                if fd >= 0:
                    os.close(fd)
                if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
                    raise CheckpointError(f"cannot open the expert repack file {rp.file}: {e.strerror or e}; "
                                          f"{rp.hint}") from None
        if not self.direct_io:
            warnings.warn(f"the filesystem of {rp.file} refuses O_DIRECT; expert reads are buffered and "
                          "followed by posix_fadvise(DONTNEED), so the page cache may still serve some of them",
                          stacklevel=2)
            try:
                self.fd = os.open(rp.file, os.O_RDONLY)
            except OSError as e:
                raise CheckpointError(f"cannot open the expert repack file {rp.file}: {e.strerror or e}; "
                                      f"{rp.hint}") from None
        self.reset_io_stats()

    @staticmethod
    def staging_for(stored_bytes: int, queue_depth: int = 1) -> int:
        """Bytes of a staged tier's rows: per read in flight, one for reads finished on the I/O thread +
        STAGE_ROWS deferred."""
        return queue_depth * (1 + DiskTier.STAGE_ROWS) * round_up(stored_bytes)

    @property
    def staging_bytes(self) -> int:
        return 0 if self.direct else self.staging_for(self.stored_bytes, self.queue_depth)

    @property
    def host_buffers(self) -> tuple[torch.Tensor, ...]:
        return tuple(self._stages) + tuple(self._rows)

    def reset_io_stats(self) -> None:
        super().reset_io_stats()
        self.max_inflight = 0  # most reads seen in flight at once

    @property
    def stride(self) -> int:
        """A slot row: the repack's whole aligned stride when reads land in it, else the decoded expert."""
        return self.rp.stride if self.direct else round_up(self.expert_bytes, 64)

    def read_into(self, layer: int, e: int, dst: torch.Tensor, *, verify: bool = True) -> None:
        """One pread of the padded stored expert, into `dst` (`direct`: an ALIGN-aligned uint8 CPU row of
        `stride` bytes), else into a staging row, verified and decoded into `dst`: here (`verify=True`, or
        when every deferred row is taken), else by `verify(layer, e, dst)`, which the caller must run before
        using `dst`. A failed or short read raises IntegrityError, and so does a checksum mismatch. Called by
        at most `queue_depth` threads at a time (the I/O threads); `verify` may run on another."""
        if dst.numel() < self.stride or (self.direct and self.direct_io and dst.data_ptr() % 4096):
            raise ValueError("disk reads need an aligned destination of stride bytes")
        idx = stage = None
        if not self.direct:
            with self._lock:
                old = self._pending.pop(dst.data_ptr(), None)  # an earlier read into dst never finished
                if old is not None:
                    self._free.append(old)
                if not verify and self._free:
                    idx = self._free.pop()
                else:
                    assert self._free_stages, f"more than queue_depth={self.queue_depth} reads at once"
                    stage = self._free_stages.pop()
        try:
            self._read(layer, e, dst if self.direct else self._stages[stage] if idx is None else self._rows[idx])
            if stage is not None:
                self._finish(layer, e, self._stages[stage], dst)
        except BaseException:
            if idx is not None:
                with self._lock:
                    self._free.append(idx)
            raise
        finally:
            if stage is not None:
                with self._lock:
                    self._free_stages.append(stage)
        if self.direct:
            if verify:
                self._check(layer, e, dst)
        elif idx is not None:
            with self._lock:
                self._pending[dst.data_ptr()] = idx

    def _finish(self, layer: int, e: int, land: torch.Tensor, dst: torch.Tensor) -> None:
        self._check(layer, e, land)
        self.fmt.load(land, dst[: self.expert_bytes].view(self.dtype))

    def _read(self, layer: int, e: int, land: torch.Tensor) -> None:
        rp = self.rp
        off = rp.offset(layer, e)
        row = land[: rp.stride].numpy()
        with self._lock:
            self._inflight += 1
            self.max_inflight = max(self.max_inflight, self._inflight)
        t0 = time.perf_counter()
        try:
            n = os.preadv(self.fd, [row], off)
        except OSError as exc:
            raise IntegrityError(f"cannot read layer {layer} expert {e} from the expert repack file {rp.file}: "
                                 f"{exc.strerror or exc}; {rp.hint}") from None
        finally:
            with self._lock:
                self._inflight -= 1
        t1 = time.perf_counter()
        if n != rp.stride:
            raise IntegrityError(f"short read of layer {layer} expert {e} from the expert repack file {rp.file}: "
                                 f"{n} of {rp.stride} bytes at offset {off} (truncated or replaced while in "
                                 f"use?); {rp.hint}")
        if not self.direct_io:
            os.posix_fadvise(self.fd, off, rp.stride, os.POSIX_FADV_DONTNEED)
        with self._lock:  # summed over the reads (overlapping ones each count their own time)
            self.read_s += t1 - t0
            self.reads += 1

    def verify(self, layer: int, e: int, dst: torch.Tensor) -> None:
        """Finish a `read_into(..., verify=False)`: the expert's checksum (stored at repack time) against the
        bytes read, then (staged reads) the decode into `dst`. Nothing to do for a read finished already."""
        if self.direct:
            self._check(layer, e, dst)
            return
        with self._lock:
            idx = self._pending.pop(dst.data_ptr(), None)
        if idx is None:
            return
        try:
            self._finish(layer, e, self._rows[idx], dst)
        finally:
            with self._lock:
                self._free.append(idx)

    def _check(self, layer: int, e: int, buf: torch.Tensor) -> None:
        t0 = time.perf_counter()
        rp = self.rp
        if checksum(buf[: rp.stride].numpy()) != rp.sums[rp.index(layer, e)]:
            off = rp.offset(layer, e)
            raise IntegrityError(f"expert repack file {rp.file} is corrupt: layer {layer} expert {e} (bytes "
                                 f"{off}-{off + rp.stride}) fails its checksum; {rp.hint}")
        self.verify_s += time.perf_counter() - t0

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __del__(self):
        self.close()


def slot_bytes(tier: Tier) -> int:
    """Bytes of one device slot: the tier reads whole strides into it."""
    return tier.stride
