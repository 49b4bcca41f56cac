"""All experts resident on the compute device: the reference every offloaded tier must equal."""
from __future__ import annotations

import torch
from tqdm import tqdm

from specmoe.weights.checkpoint import Checkpoint


class ResidentExperts:
    """Every expert of every MoE layer packed in one [E, 3·I·D] tensor per layer."""

    def __init__(self, ckpt: Checkpoint, dtype: torch.dtype, device: torch.device | str = "cpu",
                 progress: bool = False):
        cfg = ckpt.config
        self.layers: dict[int, torch.Tensor] = {}
        bar = tqdm(total=len(cfg.moe_layers) * cfg.num_experts, desc="experts", unit="exp", disable=not progress,
                   leave=False)
        for layer in cfg.moe_layers:
            buf = torch.empty(cfg.num_experts, cfg.expert_numel, dtype=dtype, device=device)
            for e in range(cfg.num_experts):
                buf[e].copy_(ckpt.read_expert(layer, e, dtype))
                bar.update()
            self.layers[layer] = buf
        bar.close()
        self.nbytes = sum(t.numel() * t.element_size() for t in self.layers.values())

    def fetch(self, layer: int, ids: list[int]):
        store = self.layers[layer]
        for e in ids:
            yield e, store[e]
