"""Expert storage formats: how one expert's weights are laid out as bytes in a tier, and how those bytes
become the compute-dtype expert a device slot holds.

An expert is packed as [gate (I·D); up (I·D); down (D·I)] (row-major, output channels as rows). A
format turns that packed expert into stored bytes (`encode`, done once: by the repack or by
`specmoe quantize`) and stored bytes back into the compute dtype (`decode`, on every arrival in a
slot). Tiers and the repack hold stored bytes, so `bytes_moved` counts them; the MoE block only ever
sees decoded slots, so plain and speculative decoding compute on the same numbers, and an offloaded
model decodes exactly what the resident one does.

Formats (`expert_format=`):
- `checkpoint`: the checkpoint's own dtype (`Plain`): bf16 stays bf16 in host RAM and on disk, and is
  upcast on arrival when the model computes in fp32;
- `int8`: one int8 per weight, one fp32 scale per output channel (row): w ≈ q · s, s = max|row| / 127;
- `int4` (`int4-g32`) / `int4-g64`: two 4-bit values per byte (low nibble first), one fp16 scale per
  group of 32 / 64 consecutive weights of the packed expert (groups never span two of the three
  matrices; they span rows only where a row is not a multiple of the group): w ≈ (n − 8) · s,
  s = max|group| / 7.

- `mxfp4` / `fp8-block` (`Native`): the experts of a checkpoint that ships them quantized, kept as it stores
  them (GPT-OSS: MXFP4 blocks and e8m0 scales, biases in the checkpoint's dtype; DeepSeek-V3: float8 e4m3 weights
  and fp32 128×128 block scales): each stored tensor of one expert, 16-byte aligned. Read from the checkpoint, not
  encoded, and decoded by the checkpoint's own dequantisation (weights/quantized.py). `checkpoint` means this
  format for such a checkpoint.
"""
from __future__ import annotations

import math
import threading
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from specmoe.errors import InputError
from specmoe.weights.quantized import StoredLayout, assemble, stored_layout

if TYPE_CHECKING:
    from specmoe.weights.checkpoint import Checkpoint

FORMATS = ("checkpoint", "int8", "int4", "int4-g32", "int4-g64", "mxfp4", "fp8-block")
QUANTIZED = ("int8", "int4-g32", "int4-g64")  # made by specmoe from floating-point weights, kept in the repack
NATIVE = {"mxfp4": "mxfp4", "fp8": "fp8-block"}  # quantization method of a checkpoint -> its experts' format
DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
STORED = torch.uint8  # the slot "dtype" of slots that hold a quantized format's own bytes (native kernels)


@dataclass(frozen=True)
class ExpertShape:
    """The matrices of one expert, as (rows, cols) in packed order: gate [I, D], up [I, D], down [D, I] (not
    `gated`, NLLB-MoE: fc1 [I, D], fc2 [D, I]); with `bias` the biases [gate (I); up (I); down (D)] (fc1 (I); fc2 (D))
    follow them."""
    hidden: int  # D
    inter: int  # I
    bias: bool = False
    stored: StoredLayout | None = None  # a checkpoint that ships quantized experts: how it stores one
    gated: bool = True

    @property
    def mats(self) -> tuple[tuple[int, int], ...]:
        D, I = self.hidden, self.inter
        return ((I, D), (I, D), (D, I)) if self.gated else ((I, D), (D, I))

    @property
    def weights(self) -> int:
        return sum(r * c for r, c in self.mats)

    @property
    def bias_numel(self) -> int:
        return (2 if self.gated else 1) * self.inter + self.hidden if self.bias else 0

    @property
    def numel(self) -> int:
        return self.weights + self.bias_numel

    @classmethod
    def of(cls, cfg) -> "ExpertShape":
        return cls(hidden=cfg.hidden_size, inter=cfg.expert_intermediate_size, bias=cfg.expert_bias,
                   gated=cfg.gated_experts,
                   stored=stored_layout(cfg))


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


CHUNK = 1 << 18  # elements dequantised per pass: the fp32 temporary stays ~1 MiB, reused, cache-resident
_scratch = threading.local()  # per thread (the I/O thread and the compute thread decode concurrently)


def _temp(name: str, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A reusable per-thread scratch buffer (a fresh multi-MiB temporary costs page faults on every decode:
    ~10x the arithmetic on a busy machine)."""
    key = (name, dtype, str(device))
    buf = getattr(_scratch, "bufs", None)
    if buf is None:
        buf = _scratch.bufs = {}
    t = buf.get(key)
    if t is None or t.numel() < n:
        t = buf[key] = torch.empty(max(n, CHUNK), dtype=dtype, device=device)
    return t[:n]


class ExpertFormat(ABC):
    """Contract: `stored_bytes` bytes per expert; `encode(w)` maps a packed expert (any float dtype, flat
    [numel]) to a uint8 tensor of exactly `stored_bytes`; `decode(src, out)` writes the expert into `out`
    (flat [numel], the compute dtype, on any device) from `src` (uint8, at least `stored_bytes`, same
    device as `out`). `decode` is deterministic: the same bytes give the same compute-dtype values
    everywhere they are decoded. `from_checkpoint(ckpt, layer, e)` is an expert's stored bytes, made from the
    checkpoint (`encode` of its weights; a checkpoint's own quantized format reads them as stored and has no
    `encode`)."""
    name: str
    shape: ExpertShape

    @property
    @abstractmethod
    def stored_bytes(self) -> int:
        ...

    @abstractmethod
    def encode(self, w: torch.Tensor) -> torch.Tensor:
        ...

    @abstractmethod
    def decode(self, src: torch.Tensor, out: torch.Tensor) -> None:
        ...

    @property
    def quantized(self) -> bool:
        """Made by specmoe from floating-point weights (int8 / int4): kept in the repack, read from there."""
        return self.name in QUANTIZED

    def from_checkpoint(self, ckpt: "Checkpoint", layer: int, e: int) -> torch.Tensor:
        """Expert (layer, e) of `ckpt` in this format: its stored bytes (quantized formats quantise the weights
        read in fp32)."""
        return self.encode(ckpt.read_expert(layer, e, torch.float32))

    def identity(self, dtype: torch.dtype) -> bool:
        """The stored bytes are the compute-dtype expert itself (a read can land straight in a slot)."""
        return False

    def slot_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one expert in a slot of `dtype`: the stored bytes for `STORED` (slots that keep the format's
        bytes, computed from by the native kernels), else the expert in that float dtype."""
        return self.stored_bytes if dtype == STORED else self.shape.numel * torch.empty((), dtype=dtype).element_size()

    def load(self, src: torch.Tensor, out: torch.Tensor) -> None:
        """Fill a slot: `out` of dtype `STORED` gets the stored bytes as they are, else `decode`."""
        if out.dtype == STORED:
            out[: self.stored_bytes].copy_(src[: self.stored_bytes])
        else:
            self.decode(src, out)

    @property
    def native_stored(self) -> bool:
        """The native kernels compute from this format's stored bytes (`stored_views`)."""
        return False

    def stored_views(self, rows: torch.Tensor) -> tuple | None:
        """Views of slots holding the stored bytes (rows uint8 [S, ≥ stored_bytes], any row stride aligned to 64 bytes)
        as the native kernels take them: (gate_up, down, gate_up bias, down bias, gate_up scale, down scale, group);
        None where this format is not computed from its stored bytes."""
        return None

    def _parts(self, flat: torch.Tensor):
        """Views of the three matrices of a flat packed expert."""
        off = 0
        for r, c in self.shape.mats:
            yield flat[off:off + r * c].view(r, c)
            off += r * c


class Plain(ExpertFormat):
    """The packed expert in a float dtype (the checkpoint's)."""

    def __init__(self, shape: ExpertShape, dtype: torch.dtype):
        self.shape, self.dtype, self.name = shape, dtype, DTYPE_NAMES[dtype]

    @property
    def stored_bytes(self) -> int:
        return self.shape.numel * torch.empty((), dtype=self.dtype).element_size()

    def encode(self, w: torch.Tensor) -> torch.Tensor:
        return w.reshape(-1).to(self.dtype).contiguous().view(torch.uint8)

    def decode(self, src: torch.Tensor, out: torch.Tensor) -> None:
        out.copy_(src[: self.stored_bytes].view(self.dtype))  # an exact upcast when out is wider

    def identity(self, dtype: torch.dtype) -> bool:
        return dtype == self.dtype

    def from_checkpoint(self, ckpt: "Checkpoint", layer: int, e: int) -> torch.Tensor:
        return self.encode(ckpt.read_expert(layer, e, self.dtype))


class Int8(ExpertFormat):
    """int8 weights (all three matrices, packed order), padded to 16 bytes, then one fp32 scale per row, then
    the expert biases (if any) in fp32."""
    name = "int8"

    def __init__(self, shape: ExpertShape):
        self.shape = shape
        self.rows = sum(r for r, _ in shape.mats)
        self.q_bytes = _align(shape.weights, 16)
        self.bias_at = self.q_bytes + 4 * self.rows

    @property
    def stored_bytes(self) -> int:
        return self.bias_at + 4 * self.shape.bias_numel

    def encode(self, w: torch.Tensor) -> torch.Tensor:
        w = w.reshape(-1).float()
        out = torch.zeros(self.stored_bytes, dtype=torch.uint8)
        q = out[: self.shape.weights].view(torch.int8)
        s = out[self.q_bytes:self.bias_at].view(torch.float32)
        _encode_bias(self.shape, w, out[self.bias_at:])
        qoff = soff = 0
        for m in self._parts(w):
            r, c = m.shape
            scale = m.abs().amax(dim=1) / 127.0
            inv = torch.where(scale > 0, 1.0 / torch.where(scale > 0, scale, 1.0), 0.0)
            q[qoff:qoff + r * c].view(r, c).copy_(torch.round(m * inv[:, None]).clamp_(-127, 127).to(torch.int8))
            s[soff:soff + r] = scale
            qoff, soff = qoff + r * c, soff + r
        return out

    def identity(self, dtype: torch.dtype) -> bool:
        return dtype == STORED

    native_stored = True

    def stored_views(self, rows: torch.Tensor) -> tuple:
        sh = self.shape
        g, D, I = sh.mats[0][0] * (2 if sh.gated else 1), sh.hidden, sh.inter
        q = rows[:, : sh.weights].view(torch.int8)
        s = rows[:, self.q_bytes:self.bias_at].view(torch.float32)
        gub = db = None
        if sh.bias:
            b = rows[:, self.bias_at:self.bias_at + 4 * sh.bias_numel].view(torch.float32)
            gub, db = b[:, :g], b[:, g:g + D]
        return (q[:, : g * D].unflatten(1, (g, D)), q[:, g * D:].unflatten(1, (D, I)), gub, db, s[:, :g],
                s[:, g:g + D], 32)

    def decode(self, src: torch.Tensor, out: torch.Tensor) -> None:
        q = src[: self.shape.weights].view(torch.int8)
        s = src[self.q_bytes:self.bias_at].view(torch.float32)
        _decode_bias(self.shape, src[self.bias_at:self.stored_bytes], out)
        soff = 0
        for qm, om in zip(self._parts(q), self._parts(out)):
            r, c = qm.shape
            step = max(1, CHUNK // c)  # rows per pass
            for i in range(0, r, step):
                j = min(r, i + step)
                if om.dtype == torch.float32:
                    torch.mul(qm[i:j], s[soff + i:soff + j, None], out=om[i:j])
                else:  # int8 x fp32 in fp32, then one rounding to the compute dtype
                    tmp = _temp("int8", (j - i) * c, torch.float32, out.device).view(j - i, c)
                    torch.mul(qm[i:j], s[soff + i:soff + j, None], out=tmp)
                    om[i:j].copy_(tmp)
            soff += r


class Int4(ExpertFormat):
    """4-bit weights two per byte (low nibble = even index), each matrix padded to whole groups, then one
    fp16 scale per group, then the expert biases (if any) in fp32."""

    def __init__(self, shape: ExpertShape, group: int = 32):
        if group not in (32, 64):
            raise InputError(f"int4 group size must be 32 or 64, got {group!r}")
        self.shape, self.group, self.name = shape, group, f"int4-g{group}"
        self.groups = [math.ceil(r * c / group) for r, c in shape.mats]  # per matrix
        self.n_groups = sum(self.groups)
        self.q_bytes = _align(self.n_groups * group // 2, 16)
        self.bias_at = _align(self.q_bytes + 2 * self.n_groups, 4)

    @property
    def stored_bytes(self) -> int:
        return self.bias_at + 4 * self.shape.bias_numel

    def encode(self, w: torch.Tensor) -> torch.Tensor:
        w = w.reshape(-1).float()
        G = self.group
        padded = torch.zeros(self.n_groups * G)
        off = goff = 0
        for (r, c), g in zip(self.shape.mats, self.groups):
            padded[goff * G: goff * G + r * c] = w[off:off + r * c]
            off, goff = off + r * c, goff + g
        groups = padded.view(self.n_groups, G)
        scale = (groups.abs().amax(dim=1) / 7.0)
        if not torch.isfinite(scale.half()).all():
            raise InputError("int4: a weight group's scale does not fit in fp16 (weights larger than ~4.5e5); "
                             "use expert_format='int8'")
        scale = scale.half().float()  # quantise against the scale that will be stored
        inv = torch.where(scale > 0, 1.0 / torch.where(scale > 0, scale, 1.0), 0.0)
        n = (torch.round(groups * inv[:, None]).clamp_(-7, 7) + 8).to(torch.uint8).view(-1)
        out = torch.zeros(self.stored_bytes, dtype=torch.uint8)
        out[: n.numel() // 2] = n[0::2] | (n[1::2] << 4)
        out[self.q_bytes:self.q_bytes + 2 * self.n_groups].view(torch.float16).copy_(scale.half())
        _encode_bias(self.shape, w, out[self.bias_at:])
        return out

    def identity(self, dtype: torch.dtype) -> bool:
        return dtype == STORED

    @property
    def native_stored(self) -> bool:
        """Every row of every matrix is whole groups (the native kernels' int4 layout)."""
        return all(c % self.group == 0 for _, c in self.shape.mats)

    def stored_views(self, rows: torch.Tensor) -> tuple | None:
        if not self.native_stored:
            return None
        sh, G = self.shape, self.group
        g, D, I = sh.mats[0][0] * (2 if sh.gated else 1), sh.hidden, sh.inter
        s = rows[:, self.q_bytes:self.q_bytes + 2 * self.n_groups].view(torch.float16)
        gub = db = None
        if sh.bias:
            b = rows[:, self.bias_at:self.bias_at + 4 * sh.bias_numel].view(torch.float32)
            gub, db = b[:, :g], b[:, g:g + D]
        nb = g * D // 2
        return (rows[:, :nb].unflatten(1, (g, D // 2)), rows[:, nb:nb + D * I // 2].unflatten(1, (D, I // 2)), gub, db,
                s[:, : g * D // G].unflatten(1, (g, D // G)), s[:, g * D // G: g * D // G + D * I // G].unflatten(
                    1, (D, I // G)), G)

    def decode(self, src: torch.Tensor, out: torch.Tensor) -> None:
        G = self.group
        s = src[self.q_bytes:self.q_bytes + 2 * self.n_groups].view(torch.float16)
        _decode_bias(self.shape, src[self.bias_at:self.stored_bytes], out)
        step = max(1, CHUNK // G)  # groups per pass
        off = goff = 0
        for (r, c), g in zip(self.shape.mats, self.groups):
            numel = r * c
            for i in range(0, g, step):
                k = min(g, i + step) - i  # groups in this pass
                packed = src[(goff + i) * G // 2:(goff + i + k) * G // 2]
                n = _temp("nibbles", k * G, torch.uint8, out.device).view(-1, 2)
                torch.bitwise_and(packed, 0xF, out=n[:, 0])
                torch.bitwise_right_shift(packed, 4, out=n[:, 1])
                vals = _temp("int4", k * G, torch.float32, out.device).view(k, G)
                vals.copy_(n.view(k, G))
                vals.sub_(8.0).mul_(s[goff + i:goff + i + k, None])
                m = min(k * G, numel - i * G)  # the matrix's last group may be padding
                out[off + i * G: off + i * G + m].copy_(vals.view(-1)[:m])
            off, goff = off + numel, goff + g


class Native(ExpertFormat):
    """The experts as the checkpoint stores them (`shape.stored`): each stored tensor of one expert (GPT-OSS:
    gate_up blocks, scales, down blocks, scales, gate_up bias, down bias; FP8: gate weight, scales, up, down),
    in that order, each starting on a 16-byte boundary. Decoded by `weights.quantized.assemble`, the path
    resident experts are read by."""

    def __init__(self, shape: ExpertShape):
        if shape.stored is None:
            raise InputError("this checkpoint stores its experts in floating point, not in a quantized format")
        self.shape, self.layout, self.name = shape, shape.stored, NATIVE[shape.stored.method]
        self.offsets, off = [], 0
        for t in self.layout.tensors:
            self.offsets.append(off)
            off = _align(off + t.nbytes, 16)
        self._bytes = off

    @property
    def stored_bytes(self) -> int:
        return self._bytes

    def encode(self, w: torch.Tensor) -> torch.Tensor:
        raise InputError(f"{self.name} experts are read as the checkpoint stores them; specmoe does not quantize "
                         f"floating-point weights to {self.name} (use int8 or int4)")

    def pack(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        """The stored bytes of one expert from its stored tensors (`layout.tensors` order, shapes and dtypes)."""
        out = torch.zeros(self.stored_bytes, dtype=torch.uint8)
        for t, spec, off in zip(tensors, self.layout.tensors, self.offsets):
            if tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
                raise InputError(f"{self.name}: a stored tensor is {list(t.shape)} {t.dtype}, expected "
                                 f"{list(spec.shape)} {spec.dtype}")
            out[off:off + spec.nbytes] = t.contiguous().reshape(-1).view(torch.uint8)
        return out

    def from_checkpoint(self, ckpt: "Checkpoint", layer: int, e: int) -> torch.Tensor:
        return self.pack(ckpt.read_stored(layer, e))

    def decode(self, src: torch.Tensor, out: torch.Tensor) -> None:
        tensors = [src[off:off + t.nbytes].view(t.dtype).view(t.shape)
                   for t, off in zip(self.layout.tensors, self.offsets)]
        assemble(self.layout, tensors, out)


def _encode_bias(shape: ExpertShape, w: torch.Tensor, dst: torch.Tensor) -> None:
    """Expert biases are few: kept exact, in fp32."""
    if shape.bias_numel:
        dst.view(torch.float32).copy_(w[shape.weights:].float())


def _decode_bias(shape: ExpertShape, src: torch.Tensor, out: torch.Tensor) -> None:
    if shape.bias_numel:
        out[shape.weights:].copy_(src.view(torch.float32))


def canonical(name: str) -> str:
    """`int4` is `int4-g32`; other names as given (validated)."""
    if name not in FORMATS:
        raise InputError(f"expert_format={name!r}; choose one of {', '.join(FORMATS)}")
    return "int4-g32" if name == "int4" else name


def make_format(name: str, shape: ExpertShape, checkpoint_dtype: torch.dtype) -> ExpertFormat:
    """The storage format `expert_format=name` means for a checkpoint whose weights are `checkpoint_dtype` (and
    whose experts are stored as `shape.stored`, if it ships them quantized)."""
    name = canonical(name)
    native = NATIVE[shape.stored.method] if shape.stored is not None else None
    if name in NATIVE.values() and name != native:
        raise InputError(f"expert_format={name!r} reads experts that the checkpoint stores as {name} (GPT-OSS "
                         "MXFP4 / DeepSeek-V3 FP8 releases); this checkpoint stores them as "
                         f"{native or DTYPE_NAMES[checkpoint_dtype]}: use 'checkpoint', 'int8' or 'int4'")
    if name == "checkpoint":
        return Native(shape) if native else Plain(shape, checkpoint_dtype)
    if name == native:
        return Native(shape)
    if name == "int8":
        return Int8(shape)
    return Int4(shape, int(name.rsplit("g", 1)[1]))


def all_formats(shape: ExpertShape, checkpoint_dtype: torch.dtype) -> list[ExpertFormat]:
    """Every format an expert of `shape` can be stored in (for `specmoe inspect`): the checkpoint's own first."""
    own = Native(shape) if shape.stored is not None else Plain(shape, checkpoint_dtype)
    return [own, Int8(shape), Int4(shape, 32), Int4(shape, 64)]


