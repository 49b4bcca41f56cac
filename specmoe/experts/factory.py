"""Build the ExpertProvider an OffloadConfig asks for."""
from __future__ import annotations

import torch

from specmoe.engine.options import OffloadConfig
from specmoe.errors import InputError
from specmoe.experts.resident import ResidentExperts
from specmoe.weights.checkpoint import Checkpoint


def build_provider(ckpt: Checkpoint, cfg: OffloadConfig, *, dtype: torch.dtype, device: torch.device,
                   progress: bool = False):
    if cfg.offload == "none":
        return ResidentExperts(ckpt, dtype, device, progress=progress)
    raise InputError(f"offload={cfg.offload!r} is not available in this build")
