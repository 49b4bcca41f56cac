"""SpecMoE's expert affinity table: pairwise L2 distance between the flattened weights of
every pair of experts in a MoE layer (arXiv 2604.10152, "affinity-based substitution").

Computed once per model and cached on disk next to the checkpoint
(`<ckpt>/.specmoe/affinity.safetensors`, or `~/.cache/specmoe/` when the checkpoint directory
is read-only), keyed and validated by `Checkpoint.fingerprint()`. The cache is a safetensors
file (no pickle, so nothing in it can run code); one that is unreadable, corrupt, stale or of
the wrong shape is recomputed and rewritten.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specmoe.weights.checkpoint import Checkpoint
from specmoe.weights.names import expert_parts

# E=experts, P=parameters of one expert part (I·D)

FORMAT = "2"  # 1 was a torch.save pickle (affinity.pt), never read now


def cache_paths(ckpt: Checkpoint) -> list[Path]:
    """Where the table may live, in order of preference."""
    key = hashlib.sha1(str(ckpt.path.resolve()).encode()).hexdigest()[:16]
    return [ckpt.path / ".specmoe" / "affinity.safetensors",
            Path.home() / ".cache" / "specmoe" / f"affinity-{key}.safetensors"]


def compute_affinity(ckpt: Checkpoint) -> dict[int, torch.Tensor]:
    """{layer: distances [E, E] fp32}. Accumulates the Gram matrix one expert part (gate, up,
    down; fc1, fc2) at a time, in fp64, so only E·I·D values of a layer are in memory at once."""
    cfg = ckpt.config
    E = cfg.num_experts
    out = {}
    for layer in cfg.moe_layers:
        gram = torch.zeros(E, E, dtype=torch.float64)
        for part in ("gate", "up", "down") if cfg.gated_experts else ("gate", "down"):  # NLLB-MoE: fc1, fc2
            w = torch.stack([ckpt.read_part(expert_parts(cfg, layer, e)[part], torch.float64).reshape(-1)
                             for e in range(E)])  # [E, P]
            gram += w @ w.T
        sq = gram.diagonal()
        d2 = (sq[:, None] + sq[None, :] - 2 * gram).clamp_min(0)  # [E, E]
        d2.fill_diagonal_(0)
        out[layer] = d2.sqrt().float()
    return out


def _load(path: Path, fingerprint: str, layers: tuple[int, ...], E: int) -> dict[int, torch.Tensor] | None:
    """The cached table, or None when the file is unreadable, corrupt, stale or malformed."""
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if (meta.get("format") != FORMAT or meta.get("fingerprint") != fingerprint
                    or json.loads(meta.get("layers", "null")) != list(layers)):
                return None
            table = {layer: f.get_tensor(f"layer.{layer}") for layer in layers}
    except Exception:  # any failure to read a cache (corrupt header, missing key...) means recompute
        return None
    for t in table.values():
        if t.dtype != torch.float32 or t.shape != (E, E) or not bool(torch.isfinite(t).all()) or bool((t < 0).any()):
            return None
    return table


def _save(path: Path, fingerprint: str, table: dict[int, torch.Tensor]) -> bool:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".affinity-", suffix=".tmp")
        os.close(fd)
        try:
            save_file({f"layer.{layer}": t.contiguous() for layer, t in table.items()}, tmp,
                      metadata={"format": FORMAT, "fingerprint": fingerprint, "layers": json.dumps(list(table))})
            os.replace(tmp, path)  # atomic: concurrent readers see the old file or the new one
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return True
    except OSError:
        return False


def load_or_compute_affinity(ckpt: Checkpoint) -> dict[int, torch.Tensor]:
    """The affinity table of `ckpt`, from the disk cache when its fingerprint matches."""
    fp, layers = ckpt.fingerprint(), tuple(ckpt.config.moe_layers)
    paths = cache_paths(ckpt)
    for p in paths:
        if p.is_file():
            table = _load(p, fp, layers, ckpt.config.num_experts)
            if table is not None:
                return table
    table = compute_affinity(ckpt)
    for p in paths:
        if _save(p, fp, table):
            break
    return table


def nearest_draft(dist: torch.Tensor, draft_ids: torch.Tensor) -> torch.Tensor:
    """dist [E, E], draft_ids [Nd] → [E]: for every expert, the draft expert nearest to it
    (a draft expert maps to itself, its distance being 0)."""
    out = draft_ids[dist.to(draft_ids.device)[:, draft_ids].argmin(dim=1)]
    out[draft_ids] = draft_ids  # ties at distance 0 (duplicate experts) must not move a draft expert
    return out
