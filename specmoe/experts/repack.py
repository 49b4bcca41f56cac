"""One-time repack of a checkpoint's experts into one aligned file for direct reads.

Layout: every expert of every MoE layer, packed as [gate (I·D); up (I·D); down (D·I)] in
the compute dtype and padded to a 4096-byte boundary, at offset (li·E + e)·stride where li
is the layer's index among the MoE layers. A fetch is then one aligned read (O_DIRECT).

A manifest next to the file records the source checkpoint's `fingerprint()` and a CRC32 of
every expert. On open the fingerprint must match and a sample of experts must match their
CRC both in the repack file and in the source checkpoint. A checkpoint changed after
repacking is an error, not a silent re-repack: the mismatch may come from a half-written
or swapped checkpoint, and the user should decide (delete the repack dir to repack); the
repack file is never touched on a mismatch.
"""
from __future__ import annotations

import hashlib
import json
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from specmoe.errors import CheckpointError, InputError
from specmoe.experts.memory import round_up
from specmoe.weights.checkpoint import Checkpoint

FORMAT = 1
SAMPLE = 8  # experts re-checksummed on every open


@dataclass(frozen=True)
class Repacked:
    """An opened, validated repack: where expert (layer, e) sits in `file`."""
    file: Path
    manifest: Path
    moe_layers: tuple[int, ...]
    num_experts: int
    expert_numel: int
    expert_bytes: int
    stride: int
    dtype: torch.dtype

    def offset(self, layer: int, expert: int) -> int:
        return (self.moe_layers.index(layer) * self.num_experts + expert) * self.stride


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def expert_bytes_of(ckpt: Checkpoint, layer: int, e: int, dtype: torch.dtype) -> bytes:
    return ckpt.read_expert(layer, e, dtype).contiguous().view(torch.uint8).numpy().tobytes()


def candidate_dirs(ckpt: Checkpoint, repack_dir: str | Path | None) -> list[Path]:
    if repack_dir is not None:
        return [Path(repack_dir)]
    key = hashlib.sha1(str(ckpt.path.resolve()).encode()).hexdigest()[:16]
    return [ckpt.path / ".specmoe", Path.home() / ".cache" / "specmoe" / key]


def writable(d: Path) -> str | None:
    """None if we can create files in `d` (creating it), else the reason."""
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / f".probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
        return None
    except OSError as e:
        return e.strerror or str(e)


def open_repack(ckpt: Checkpoint, dtype: torch.dtype, repack_dir: str | Path | None = None, *,
                progress: bool = False) -> Repacked:
    """Return a validated repack of `ckpt`'s experts in `dtype`, repacking once if none exists."""
    name = f"experts-{dtype_name(dtype)}"
    dirs = candidate_dirs(ckpt, repack_dir)
    for d in dirs:
        if (d / f"{name}.json").is_file():
            return validate(ckpt, d / f"{name}.json", dtype)
    reasons = []
    for d in dirs:
        why = writable(d)
        if why is None:
            return validate(ckpt, repack(ckpt, d, dtype, progress=progress), dtype)
        reasons.append(f"{d} ({why})")
    hint = "pass repack_dir=DIR (--repack-dir) pointing at a writable directory"
    raise InputError(f"cannot write the expert repack file: repack dir not writable: {'; '.join(reasons)}; {hint}")


def layout(ckpt: Checkpoint, dtype: torch.dtype) -> dict:
    cfg = ckpt.config
    numel = cfg.expert_numel
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    return {"format": FORMAT, "model_type": cfg.model_type, "dtype": dtype_name(dtype),
            "moe_layers": list(cfg.moe_layers), "num_experts": cfg.num_experts, "expert_numel": numel,
            "expert_bytes": nbytes, "stride": round_up(nbytes)}


def repack(ckpt: Checkpoint, d: Path, dtype: torch.dtype, *, progress: bool = False) -> Path:
    """Write `experts-<dtype>.bin` + manifest into `d` atomically (tmp files, fsync, rename; manifest last)."""
    from tqdm import tqdm
    lay = layout(ckpt, dtype)
    name = f"experts-{lay['dtype']}"
    tmp_bin = d / f".{name}.bin.{os.getpid()}.tmp"
    sums = {}
    pad = b"\0" * (lay["stride"] - lay["expert_bytes"])
    total = len(lay["moe_layers"]) * lay["num_experts"]
    try:
        with open(tmp_bin, "wb") as f, tqdm(total=total, desc="repack experts", unit="exp", disable=not progress,
                                            leave=False) as bar:
            for layer in lay["moe_layers"]:
                for e in range(lay["num_experts"]):
                    data = expert_bytes_of(ckpt, layer, e, dtype)
                    sums[f"{layer}:{e}"] = zlib.crc32(data)
                    f.write(data)
                    f.write(pad)
                    bar.update()
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_bin, d / f"{name}.bin")
        manifest = {**lay, "file": f"{name}.bin", "file_bytes": total * lay["stride"],
                    "source": str(ckpt.path.resolve()), "fingerprint": ckpt.fingerprint(), "crc32": sums}
        tmp_man = d / f".{name}.json.{os.getpid()}.tmp"
        tmp_man.write_text(json.dumps(manifest))
        os.replace(tmp_man, d / f"{name}.json")
    except OSError as e:
        tmp_bin.unlink(missing_ok=True)
        raise InputError(f"cannot write the expert repack file in {d}: {e.strerror or e}") from None
    return d / f"{name}.json"


def sample_ids(moe_layers, num_experts: int) -> list[tuple[int, int]]:
    """A deterministic spread of (layer, expert) pairs: first, last and evenly spaced ones."""
    pairs = [(layer, e) for layer in moe_layers for e in range(num_experts)]
    if len(pairs) <= SAMPLE:
        return pairs
    step = (len(pairs) - 1) / (SAMPLE - 1)
    return [pairs[round(i * step)] for i in range(SAMPLE)]


def validate(ckpt: Checkpoint, manifest_path: Path, dtype: torch.dtype) -> Repacked:
    d = manifest_path.parent
    try:
        man = json.loads(manifest_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"expert repack manifest {manifest_path} is unreadable ({e}); delete {d} to repack") \
            from None
    lay = layout(ckpt, dtype)
    if any(man.get(k) != v for k, v in lay.items()):
        raise CheckpointError(f"expert repack in {d} was made for a different model layout or dtype; "
                              f"delete {d} to repack")
    if man.get("fingerprint") != ckpt.fingerprint():
        raise CheckpointError(
            f"checkpoint {ckpt.path} changed after its experts were repacked into {d} (weight file names, sizes "
            f"or modification times differ: repacked {man.get('fingerprint')!r}, now {ckpt.fingerprint()!r}). "
            f"The repack is stale and was not used; delete {d} to repack from the current checkpoint")
    f = d / man["file"]
    if not f.is_file() or f.stat().st_size != man["file_bytes"]:
        raise CheckpointError(f"expert repack file {f} is missing or truncated; delete {d} to repack")
    with open(f, "rb") as fh:
        for layer, e in sample_ids(lay["moe_layers"], lay["num_experts"]):
            want = man["crc32"][f"{layer}:{e}"]
            fh.seek((lay["moe_layers"].index(layer) * lay["num_experts"] + e) * lay["stride"])
            if zlib.crc32(fh.read(lay["expert_bytes"])) != want:
                raise CheckpointError(f"expert repack file {f} is corrupt (layer {layer} expert {e} checksum); "
                                      f"delete {d} to repack")
            if zlib.crc32(expert_bytes_of(ckpt, layer, e, dtype)) != want:
                raise CheckpointError(
                    f"checkpoint {ckpt.path} changed after its experts were repacked into {d} (layer {layer} "
                    f"expert {e} differs from the repack). The repack is stale and was not used; delete {d} to "
                    "repack from the current checkpoint")
    return Repacked(file=f, manifest=manifest_path, moe_layers=tuple(lay["moe_layers"]),
                    num_experts=lay["num_experts"], expert_numel=lay["expert_numel"],
                    expert_bytes=lay["expert_bytes"], stride=lay["stride"], dtype=dtype)
