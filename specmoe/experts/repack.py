"""One-time repack of a checkpoint's experts into one aligned file for direct reads.

Layout: every expert of every MoE layer, packed as [gate (I·D); up (I·D); down (D·I)] in
its storage format (experts/formats.py: the checkpoint's dtype, or int8 / int4 from `specmoe
quantize`) and padded to a 4096-byte boundary, at offset (li·E + e)·stride where li is the
layer's index among the MoE layers. A fetch is then one aligned read (O_DIRECT).

Files: `experts-<format>-<key>.bin` and its manifest `experts-<format>-<key>.json`, where
`format` is the storage format's name (`bfloat16`, `int8`, `int4-g32`, ...) and `key`
identifies the checkpoint (a hash of its resolved path), so one repack directory can serve
several checkpoints and formats; every message names this checkpoint's two files, never the
directory. The manifest records the layout, one checksum per expert (integrity.py; the
disk tier verifies every expert it reads against it) and the content fingerprint of the
checkpoint's weight files (name, size, mtime and sha256 of each).

On open:
- a manifest that is unreadable, of another format (e.g. made by an older specmoe, without
  per-read checksums) or whose data file is missing or truncated is rebuilt (with a warning);
- a weight file whose mtime changed is hashed again: same bytes (only touched or copied)
  keeps the repack; other bytes, or a layout change, is an error, not a silent re-repack: the
  mismatch may come from a half-written or swapped checkpoint, and the user should decide.
  The repack file is never touched on a mismatch;
- a sample of experts is checksummed in the repack file and in the checkpoint.

Writing goes to `.<name>.<pid>.tmp` files, fsynced and renamed (data file first, manifest
last); an exception or Ctrl-C removes them, and temp files left by a killed process are
removed at the next open. Free space is checked before writing, and a full disk or a
read-only directory is a one-line error (or, without repack_dir, a move to the next
candidate directory).
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from specmoe.errors import CheckpointError, InputError, IntegrityError
from specmoe.experts import integrity
from specmoe.experts.formats import ExpertFormat, ExpertShape, Plain
from specmoe.memory import fmt_bytes, round_up
from specmoe.weights.checkpoint import Checkpoint

FORMAT = 2  # 1: unkeyed file names, crc32 of sampled experts only (rebuilt on sight)
SAMPLE = 8  # experts re-checksummed against the checkpoint on every open


@dataclass(frozen=True)
class Repacked:
    """An opened, validated repack: where expert (layer, e) sits in `file`, and its checksum."""
    file: Path
    manifest: Path
    moe_layers: tuple[int, ...]
    num_experts: int
    expert_numel: int
    expert_bytes: int
    stride: int
    fmt: ExpertFormat
    sums: tuple[int, ...]  # integrity.checksum of each padded expert, in file order

    def index(self, layer: int, expert: int) -> int:
        return self.moe_layers.index(layer) * self.num_experts + expert

    def offset(self, layer: int, expert: int) -> int:
        return self.index(layer, expert) * self.stride

    @property
    def hint(self) -> str:
        return hint(self.file, self.manifest)

    def read(self, layer: int, expert: int) -> torch.Tensor:
        """One expert's stored bytes (a buffered read; for loading a host tier), checked against its checksum."""
        buf = np.zeros(self.stride, dtype=np.uint8)
        with open(self.file, "rb") as fh:
            fh.seek(self.offset(layer, expert))
            got = fh.readinto(memoryview(buf))
        if got != self.stride or integrity.checksum(buf) != self.sums[self.index(layer, expert)]:
            raise IntegrityError(f"expert repack file {self.file} is corrupt: layer {layer} expert {expert} fails "
                                 f"its checksum; {self.hint}")
        return torch.from_numpy(buf[: self.expert_bytes])


def hint(file: Path, manifest: Path) -> str:
    return (f"delete {file} and {manifest} (this checkpoint's repack) to repack from the checkpoint, "
            "or pass a fresh repack_dir")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def checkpoint_key(ckpt: Checkpoint) -> str:
    return hashlib.sha1(str(ckpt.path.resolve()).encode()).hexdigest()[:16]


def as_format(ckpt: Checkpoint, fmt: ExpertFormat | torch.dtype) -> ExpertFormat:
    """A storage format; a bare dtype means the packed expert in that dtype."""
    return fmt if isinstance(fmt, ExpertFormat) else Plain(ExpertShape.of(ckpt.config), fmt)


def file_base(ckpt: Checkpoint, fmt: ExpertFormat | torch.dtype) -> str:
    return f"experts-{as_format(ckpt, fmt).name}-{checkpoint_key(ckpt)}"


def expert_bytes_of(ckpt: Checkpoint, layer: int, e: int, fmt: ExpertFormat | torch.dtype) -> np.ndarray:
    """Expert (layer, e) of the checkpoint in storage format `fmt`: its stored bytes (quantized formats are
    quantised from the weights read in fp32; a checkpoint's own quantized format is read as stored)."""
    return as_format(ckpt, fmt).from_checkpoint(ckpt, layer, e).numpy()


def candidate_dirs(ckpt: Checkpoint, repack_dir: str | Path | None) -> list[Path]:
    if repack_dir is not None:
        return [Path(repack_dir)]
    return [ckpt.path / ".specmoe", Path.home() / ".cache" / "specmoe" / checkpoint_key(ckpt)]


def writable(d: Path) -> str | None:
    """None if we can create files in `d` (creating it), else the reason."""
    try:
        d.mkdir(parents=True, exist_ok=True)
        probe = d / f".probe-{os.getpid()}"
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644))
        probe.unlink()
        return None
    except OSError as e:
        return e.strerror or str(e)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: exists, not ours
        return True
    return True


def clean_stale_temps(d: Path, base: str) -> None:
    """Remove `base`'s temp files left by a process that no longer runs (a killed repack)."""
    if not d.is_dir():
        return
    for p in d.glob(f".{base}.*.tmp"):
        pid = p.name.split(".")[-2]
        if pid.isdigit() and (int(pid) == os.getpid() or not _alive(int(pid))):
            try:
                p.unlink()
            except OSError:
                pass


def find_repack(ckpt: Checkpoint, fmt: ExpertFormat | torch.dtype, repack_dir: str | Path | None = None
                ) -> Path | None:
    """The manifest of an existing repack of `ckpt` in `fmt` (not validated), or None."""
    base = file_base(ckpt, fmt)
    for d in candidate_dirs(ckpt, repack_dir):
        if (d / f"{base}.json").is_file():
            return d / f"{base}.json"
    return None


def open_repack(ckpt: Checkpoint, fmt: ExpertFormat | torch.dtype, repack_dir: str | Path | None = None, *,
                progress: bool = False) -> Repacked:
    """Return a validated repack of `ckpt`'s experts in storage format `fmt` (a dtype: the packed expert in
    that dtype), repacking (or quantizing) once if none exists."""
    fmt = as_format(ckpt, fmt)
    base = file_base(ckpt, fmt)
    dirs = candidate_dirs(ckpt, repack_dir)
    unusable = []  # this checkpoint's repacks that must be rebuilt (unreadable, old format, data file gone)
    for d in dirs:
        clean_stale_temps(d, base)
        if (d / f"{base}.json").is_file():
            rp = validate(ckpt, d / f"{base}.json", fmt)
            if isinstance(rp, Repacked):
                _remove_legacy(ckpt, fmt, dirs)
                return rp
            unusable.append(rp)
    lay = layout(ckpt, fmt)
    need = len(lay["moe_layers"]) * lay["num_experts"] * lay["stride"]
    reasons = []
    for d in dirs:
        why = writable(d)
        if why is None:
            free = shutil.disk_usage(d).free
            if free < need:
                why = f"{fmt_bytes(free)} free, the repack needs {fmt_bytes(need)}"
        if why is None:
            if unusable:
                warnings.warn(f"rebuilding this checkpoint's expert repack: {'; '.join(unusable)}", stacklevel=3)
            if reasons:
                warnings.warn(f"cannot write the expert repack in {'; '.join(reasons)}; repacking into {d}",
                              stacklevel=3)
            man = repack(ckpt, d, fmt, progress=progress)
            rp = validate(ckpt, man, fmt)
            if not isinstance(rp, Repacked):
                raise CheckpointError(f"the expert repack just written to {man} does not read back; "
                                      f"{hint(man.with_suffix('.bin'), man)}")
            _remove_legacy(ckpt, fmt, dirs)
            return rp
        reasons.append(f"{d} ({why})")
    hint_ = "pass repack_dir=DIR (--repack-dir) pointing at a writable directory with room"
    raise InputError(f"cannot write the expert repack file: {'; '.join(reasons)}; {hint_}")


def _remove_legacy(ckpt: Checkpoint, fmt: ExpertFormat, dirs: list[Path]) -> None:
    """Remove this checkpoint's format-1 repack (`experts-<dtype>.bin/.json`, no per-read checksums) once
    its replacement exists; another checkpoint's files are left alone."""
    if not isinstance(fmt, Plain):
        return
    dtype = fmt.dtype
    for d in dirs:
        man = d / f"experts-{dtype_name(dtype)}.json"
        try:
            old = json.loads(man.read_text())
            ours = isinstance(old, dict) and old.get("source") == str(ckpt.path.resolve())
        except (OSError, ValueError):
            continue
        if ours:
            for p in (d / f"experts-{dtype_name(dtype)}.bin", man):
                try:
                    p.unlink()
                except OSError:
                    pass
            warnings.warn(f"removed {man} and its data file: an old-format expert repack of {ckpt.path} "
                          "(replaced by one with per-read checksums)", stacklevel=3)


def layout(ckpt: Checkpoint, fmt: ExpertFormat | torch.dtype) -> dict:
    """The manifest's layout fields ("dtype" names the storage format; expert_bytes are stored bytes)."""
    cfg = ckpt.config
    fmt = as_format(ckpt, fmt)
    numel = cfg.expert_numel
    nbytes = fmt.stored_bytes
    return {"model_type": cfg.model_type, "dtype": fmt.name, "moe_layers": list(cfg.moe_layers),
            "num_experts": cfg.num_experts, "expert_numel": numel, "expert_bytes": nbytes, "stride": round_up(nbytes)}


def _write_all(fd: int, data) -> None:
    mv = memoryview(data).cast("B")
    while mv:
        mv = mv[os.write(fd, mv):]


def _write_file(path: Path, data) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def repack(ckpt: Checkpoint, d: Path, fmt: ExpertFormat | torch.dtype, *, progress: bool = False) -> Path:
    """Write `<base>.bin` + manifest into `d` atomically (temp files, fsync, rename; manifest last)."""
    from tqdm import tqdm
    lay = layout(ckpt, fmt)
    base = file_base(ckpt, fmt)
    tmp_bin = d / f".{base}.bin.{os.getpid()}.tmp"
    tmp_man = d / f".{base}.json.{os.getpid()}.tmp"
    total = len(lay["moe_layers"]) * lay["num_experts"]
    fd = -1
    try:
        files = ckpt.content_fingerprint()  # before reading: a change during the repack shows at the next open
        sums = []
        buf = np.zeros(lay["stride"], dtype=np.uint8)  # the padding stays zero
        fd = os.open(tmp_bin, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        with tqdm(total=total, desc=f"repack experts ({lay['dtype']})", unit="exp", disable=not progress,
                  leave=False) as bar:
            for layer in lay["moe_layers"]:
                for e in range(lay["num_experts"]):
                    buf[: lay["expert_bytes"]] = expert_bytes_of(ckpt, layer, e, fmt)
                    sums.append(integrity.checksum(buf))
                    _write_all(fd, buf)
                    bar.update()
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp_bin, d / f"{base}.bin")
        manifest = {"format": FORMAT, **lay, "file": f"{base}.bin", "file_bytes": total * lay["stride"],
                    "source": str(ckpt.path.resolve()), "checkpoint_files": files,
                    "checksum": integrity.NAME, "sums": sums}
        _write_file(tmp_man, json.dumps(manifest).encode())
        os.replace(tmp_man, d / f"{base}.json")
    except BaseException as exc:  # KeyboardInterrupt included: never leave a temp file behind
        if fd >= 0:
            os.close(fd)
        for p in (tmp_bin, tmp_man):
            try:
                p.unlink(missing_ok=True)
            except OSError:
                pass
        if not isinstance(exc, OSError):
            raise
        if exc.errno == errno.ENOSPC:
            raise InputError(f"cannot write the expert repack file in {d}: no space left on device (the repack "
                             f"needs {fmt_bytes(total * lay['stride'])}); free space there or pass repack_dir=DIR "
                             "(--repack-dir) on a disk with room") from None
        raise InputError(f"cannot write the expert repack file in {d}: {exc.strerror or exc}; pass repack_dir=DIR "
                         "(--repack-dir) pointing at a writable directory") from None
    return d / f"{base}.json"


def sample_ids(moe_layers, num_experts: int) -> list[tuple[int, int]]:
    """A deterministic spread of (layer, expert) pairs: first, last and evenly spaced ones."""
    pairs = [(layer, e) for layer in moe_layers for e in range(num_experts)]
    if len(pairs) <= SAMPLE:
        return pairs
    step = (len(pairs) - 1) / (SAMPLE - 1)
    return [pairs[round(i * step)] for i in range(SAMPLE)]


def _well_formed(man, lay: dict, data_file: str) -> bool:
    total = len(lay["moe_layers"]) * lay["num_experts"]
    return (isinstance(man, dict) and man.get("format") == FORMAT and man.get("checksum") == integrity.NAME
            and man.get("file") == data_file and isinstance(man.get("file_bytes"), int)
            and isinstance(man.get("sums"), list) and len(man["sums"]) == total
            and all(isinstance(s, int) and not isinstance(s, bool) for s in man["sums"])
            and isinstance(man.get("checkpoint_files"), dict)
            and all(isinstance(v, dict) for v in man["checkpoint_files"].values()))


def validate(ckpt: Checkpoint, manifest_path: Path, fmt: ExpertFormat | torch.dtype) -> Repacked | str:
    """The opened repack, or why it must be rebuilt (unreadable, old format, data file missing)."""
    lay = layout(ckpt, fmt)
    try:
        man = json.loads(manifest_path.read_text())
    except (OSError, ValueError) as e:
        man, why = None, f"unreadable ({e})"
    else:
        why = "made by another specmoe version or malformed"
    if not _well_formed(man, lay, manifest_path.stem + ".bin"):
        return f"{manifest_path} is {why}"
    f = manifest_path.parent / man["file"]
    fix = hint(f, manifest_path)

    def changed(what: str) -> CheckpointError:
        return CheckpointError(f"checkpoint {ckpt.path} changed after its experts were repacked into {f} ({what}). "
                               f"The repack is stale and was not used; {fix}")
    for k, v in lay.items():
        if man.get(k) != v:
            raise changed(f"{k} was {man.get(k)!r}, now {v!r}")
    old = man["checkpoint_files"]
    names = sorted(set(ckpt.key_to_file.values()))
    if sorted(old) != names:
        raise changed(f"weight files were {sorted(old)}, now {names}")
    for n in names:
        if old[n].get("size") != os.path.getsize(ckpt.path / n):
            raise changed(f"{n} was {old[n].get('size')} bytes, now {os.path.getsize(ckpt.path / n)}")
    now = ckpt.content_fingerprint(known=old)  # re-hashes only files whose mtime changed
    for n in names:
        if now[n]["sha256"] != old[n].get("sha256"):
            raise changed(f"the content of {n} differs")
    if not f.is_file() or f.stat().st_size != man["file_bytes"]:
        return f"{f} is missing or truncated"
    if now != old:  # only touched: remember the new mtimes so the next open does not hash again (best effort)
        tmp = manifest_path.parent / f".{manifest_path.stem}.json.{os.getpid()}.tmp"
        try:
            _write_file(tmp, json.dumps({**man, "checkpoint_files": now}).encode())
            os.replace(tmp, manifest_path)
        except OSError:
            pass
        finally:  # Ctrl-C included
            tmp.unlink(missing_ok=True)
    rp = Repacked(file=f, manifest=manifest_path, moe_layers=tuple(lay["moe_layers"]),
                  num_experts=lay["num_experts"], expert_numel=lay["expert_numel"],
                  expert_bytes=lay["expert_bytes"], stride=lay["stride"], fmt=as_format(ckpt, fmt),
                  sums=tuple(man["sums"]))
    buf = np.zeros(rp.stride, dtype=np.uint8)
    with open(f, "rb") as fh:
        for layer, e in sample_ids(lay["moe_layers"], lay["num_experts"]):
            want = rp.sums[rp.index(layer, e)]
            fh.seek(rp.offset(layer, e))
            got = fh.read(rp.stride)
            # the disk tier reads past the page cache: leave none of the file there (these reads and their
            # readahead; SAMPLE experts per open)
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            if integrity.checksum(np.frombuffer(got, dtype=np.uint8)) != want:
                raise IntegrityError(f"expert repack file {f} is corrupt: layer {layer} expert {e} fails its "
                                     f"checksum; {fix}")
            buf[: rp.expert_bytes] = expert_bytes_of(ckpt, layer, e, fmt)
            if integrity.checksum(buf) != want:
                raise changed(f"layer {layer} expert {e} differs from the repack")
    return rp
