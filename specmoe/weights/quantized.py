"""Checkpoints that ship quantized weights, read as stored: the published formats' dequantisation, and how one
expert's stored tensors become the packed floating-point expert.

- MXFP4 (GPT-OSS experts): FP4 e2m1 values two per byte (low nibble first) in blocks of 32 along a projection's
  input, one e8m0 exponent per block (value 2^(s − 127));
- FP8 block-scaled (DeepSeek-V3 and other fine-grained FP8 releases): float8_e4m3fn weights, one fp32
  multiplier (`weight_scale_inv`) per block of rows × columns (128 × 128 as published; edge blocks partial).

Both dequantise in fp32 and round once to the requested dtype, value for value what transformers' own
dequantisation computes (tests/formats/test_formats.py).

`StoredLayout` describes one expert's stored tensors (the same for every expert of a checkpoint) and `assemble`
turns them into the packed expert [gate (I·D); up (I·D); down (D·I)] (+ GPT-OSS's biases). It is the one path
from stored bytes to compute weights: `Checkpoint.read_expert` (resident experts) and the `mxfp4` / `fp8-block`
expert formats (experts/formats.py: tiers keep and move the stored bytes, and decode them on arrival in a slot)
both call it, so offloaded experts equal resident ones bit for bit.
"""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import torch

from specmoe.config import ModelConfig
from specmoe.errors import InputError
from specmoe.weights.names import ExpertPart, expert_parts, stored_tensors

FP4_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCKS_PER_PASS = 1 << 12  # MXFP4 blocks dequantised per pass (128 Ki values: the temporaries stay cache-sized)
VALUES_PER_PASS = 1 << 16  # FP8 values per pass, in whole rows of one scale block row
_luts: dict[tuple[str, str], torch.Tensor] = {}
_lock = threading.Lock()


def _lut(name: str, device: torch.device) -> torch.Tensor:
    """Lookup tables, per device: "fp4pairs" [256] int64, the two FP4 values of every byte as two fp32 (low
    nibble first); "e8m0" [256] fp32, 2^(s − 127) (what torch.ldexp multiplies by); "fp8" [256] fp32, every
    float8_e4m3fn bit pattern. A lookup is exact and several times faster than unpacking nibbles or converting
    float8 on a CPU."""
    key = (name, str(device))
    lut = _luts.get(key)
    if lut is None:
        b = torch.arange(256)
        if name == "fp4pairs":
            vals = torch.tensor(FP4_E2M1, dtype=torch.float32)
            lut = torch.stack((vals[b & 0x0F], vals[b >> 4]), dim=1).contiguous().view(torch.int64).view(256)
        elif name == "e8m0":
            lut = torch.pow(2.0, (b - 127).to(torch.int32))
        else:
            lut = b.to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float32)
        lut = lut.to(device)
        with _lock:
            _luts[key] = lut
    return lut


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16, *,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """MXFP4: `blocks` [..., G, 16] uint8 holds 32 FP4 e2m1 values per block, two per byte (low nibble first);
    `scales` [..., G] uint8 is each block's e8m0 exponent. Returns [..., G·32] in `dtype` (or writes `out`, a
    contiguous tensor of that shape): value · 2^(s − 127) in fp32, rounded once. GPT-OSS's `*_blocks` tensors
    are [E, out, G, 16]: the result is [E, out, in], output channels as rows, as in the packed expert."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise InputError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise InputError(f"MXFP4 blocks {list(blocks.shape)} do not match scales {list(scales.shape)} "
                         "(expected blocks [..., G, 16] and scales [..., G])")
    shape = (*blocks.shape[:-2], blocks.shape[-2] * 32)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=blocks.device)
    elif tuple(out.shape) != shape or not out.is_contiguous():
        raise InputError(f"MXFP4 output {list(out.shape)} does not match blocks {list(blocks.shape)}")
    rows, exps, dst = blocks.reshape(-1, 16), scales.reshape(-1), out.view(-1, 16, 2)
    pairs, pow2 = _lut("fp4pairs", blocks.device), _lut("e8m0", blocks.device)
    for i in range(0, rows.shape[0], BLOCKS_PER_PASS):
        j = min(rows.shape[0], i + BLOCKS_PER_PASS)
        v = pairs.index_select(0, rows[i:j].reshape(-1).to(torch.int32)).view(torch.float32).view(j - i, 16, 2)
        torch.mul(v, pow2.index_select(0, exps[i:j].to(torch.int32)).view(-1, 1, 1), out=dst[i:j])
    return out


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128),
                          dtype: torch.dtype = torch.bfloat16, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """Block-scaled FP8: `weight` [R, C] float8_e4m3fn, `scale_inv` [⌈R/br⌉, ⌈C/bc⌉] (fp32), one multiplier per
    `block` (edge blocks may be partial). Returns weight · scale in `dtype` (or writes `out`, [R, C]), computed
    in fp32 and rounded once."""
    br, bc = block
    if weight.dim() != 2 or weight.dtype != torch.float8_e4m3fn:
        raise InputError(f"FP8 weight must be a 2-D float8_e4m3fn tensor, got {list(weight.shape)} {weight.dtype}")
    R, C = weight.shape
    want = (math.ceil(R / br), math.ceil(C / bc))
    if tuple(scale_inv.shape) != want:
        raise InputError(f"FP8 scales {list(scale_inv.shape)} do not match weight {list(weight.shape)} with "
                         f"{br}x{bc} blocks (expected [{want[0]}, {want[1]}])")
    if out is None:
        out = torch.empty(R, C, dtype=dtype, device=weight.device)
    s = scale_inv.to(torch.float32).repeat_interleave(bc, dim=1)[:, :C]  # [R/br, C]
    lut, u = _lut("fp8", weight.device), weight.view(torch.uint8)
    step = max(1, VALUES_PER_PASS // max(1, C))
    i = 0
    while i < R:
        j = min(R, i + step, (i // br + 1) * br)  # rows of one scale block row
        torch.mul(lut.index_select(0, u[i:j].reshape(-1).to(torch.int32)).view(j - i, C), s[i // br], out=out[i:j])
        i = j
    return out


@dataclass(frozen=True)
class StoredTensor:
    """One expert's row of one stored tensor: its shape and the dtype it is kept in."""
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


@dataclass(frozen=True)
class StoredLayout:
    """How a checkpoint with quantized experts stores one expert (the same for all of its experts): `tensors` in
    stored order (names.stored_tensors), and for each packed part (gate, up, down, biases) the part's cut
    (`ExpertPart`, keys of the first expert) with the index of its tensor and of its scales (None: a float
    tensor)."""
    method: str  # "mxfp4" | "fp8"
    block: tuple[int, int]
    tensors: tuple[StoredTensor, ...]
    parts: tuple[tuple[ExpertPart, int, int | None], ...]

    @property
    def scale_dtype(self) -> torch.dtype:
        return scale_dtype(self.method)


def scale_dtype(method: str) -> torch.dtype:
    """The dtype scales are kept in: MXFP4 e8m0 exponents uint8; FP8 multipliers fp32 (whatever float dtype the
    file holds them in)."""
    return torch.uint8 if method == "mxfp4" else torch.float32


def stored_layout(cfg: ModelConfig) -> StoredLayout | None:
    """The stored layout of `cfg`'s experts (None for a floating-point checkpoint). Weights keep their quantized
    dtype (uint8 blocks / float8_e4m3fn), MXFP4 scales are uint8, FP8 scales fp32, and float tensors (biases)
    the checkpoint's dtype."""
    q = cfg.quantization
    if q is None:
        return None
    parts = expert_parts(cfg, cfg.moe_layers[0], 0)
    st = stored_tensors(parts)
    index = {key: i for i, (key, _, _, _) in enumerate(st)}
    quantized = {p.key for p in parts.values() if p.scale is not None}
    wdtype = torch.uint8 if q.method == "mxfp4" else torch.float8_e4m3fn
    fdtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[cfg.dtype]
    sdtype = scale_dtype(q.method)
    tensors = tuple(StoredTensor(shape, sdtype if is_scale else wdtype if key in quantized else fdtype)
                    for key, _, shape, is_scale in st)
    return StoredLayout(q.method, q.block, tensors,
                        tuple((p, index[p.key], index[p.scale] if p.scale else None) for p in parts.values()))


def part_shape(method: str, part: ExpertPart, t: torch.Tensor) -> tuple[int, int]:
    """The packed shape of a quantized part, from its stored tensor row `t`."""
    if method == "mxfp4":  # blocks [out, in/32, 16]: the part is the output rows start:stop:step
        return len(range(*slice(part.start, part.stop, part.step).indices(t.shape[0]))), t.shape[1] * 32
    return tuple(t.shape)


def dequantize_part(method: str, block: tuple[int, int], part: ExpertPart, t: torch.Tensor, scales: torch.Tensor,
                    out: torch.Tensor) -> None:
    """Write a quantized part into `out` (its packed shape, any float dtype): the values transformers'
    dequantised model holds, cut as `part` says. MXFP4 parts are transposed views of the dequantised
    [out, in] blocks (GPT-OSS's [in, out] parameters): the part is the blocks' rows start:stop:step, dequantised
    straight into `out`; FP8 parts are whole tensors."""
    if method == "mxfp4":
        if not part.transpose:
            raise InputError(f"an MXFP4 part is cut from a transposed parameter; {part.key} is not")
        sl = slice(part.start, part.stop, part.step)
        dequantize_mxfp4(t[sl], scales[sl], out=out)
    else:
        if part.step != 1 or part.start or part.stop is not None or part.transpose:
            raise InputError(f"an FP8 part is a whole stored tensor; {part.key} is cut")
        dequantize_fp8_blocks(t, scales, block, out=out)


def cut(part: ExpertPart, t: torch.Tensor) -> torch.Tensor:
    """A float part's values from its tensor row: transposed if `transpose`, then its rows start:stop:step."""
    t = t.T if part.transpose else t
    if part.step != 1 or part.start or part.stop is not None:
        t = t[part.start:part.stop:part.step]
    return t


def assemble(layout: StoredLayout, tensors: list[torch.Tensor], out: torch.Tensor) -> None:
    """Write the packed expert into `out` (flat [numel], any float dtype and device) from its stored tensors
    (`layout.tensors` order and dtypes, on out's device): quantized parts dequantised in fp32 straight into their
    place (rounded once to out's dtype), float parts cut and copied."""
    off = 0
    for part, ti, si in layout.parts:
        t = tensors[ti]
        if si is None:
            v = cut(part, t)
            shape = tuple(v.shape)
        else:
            shape = part_shape(layout.method, part, t)
        n = math.prod(shape)
        if off + n > out.numel():
            break
        dst = out[off:off + n].view(shape)
        if si is None:
            dst.copy_(v)
        else:
            dequantize_part(layout.method, layout.block, part, t, tensors[si], dst)
        off += n
    if off != out.numel():
        raise InputError(f"the stored expert does not fill the packed expert of {out.numel()} values")
