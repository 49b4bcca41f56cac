"""All experts resident on the compute device: the reference every offloaded tier must equal."""
from __future__ import annotations

import torch
from tqdm import tqdm

from specmoe.experts.store import ExpertStore
from specmoe.weights.checkpoint import Checkpoint


class ResidentExperts(ExpertStore):
    """Every expert of every MoE layer packed in one [E, 3·I·D] tensor per layer."""

    def __init__(self, ckpt: Checkpoint, dtype: torch.dtype, device: torch.device | str = "cpu",
                 progress: bool = False, reader=None):
        """`reader(layer, e, out)` fills one expert's row (quantized formats decode their stored bytes);
        default: the checkpoint's weights in `dtype`."""
        cfg = ckpt.config
        self.moe_layers = tuple(cfg.moe_layers)
        self.num_experts = cfg.num_experts
        self.layers: dict[int, torch.Tensor] = {}
        bar = tqdm(total=len(cfg.moe_layers) * cfg.num_experts, desc="experts", unit="exp", disable=not progress,
                   leave=False)
        for layer in cfg.moe_layers:
            buf = torch.empty(cfg.num_experts, cfg.expert_numel, dtype=dtype, device=device)
            for e in range(cfg.num_experts):
                if reader is not None:
                    reader(layer, e, buf[e])
                else:
                    buf[e].copy_(ckpt.read_expert(layer, e, dtype))
                bar.update()
            self.layers[layer] = buf
        bar.close()
        self.nbytes = sum(t.numel() * t.element_size() for t in self.layers.values())
        self.forward_observers = [self.observe]
        self.forward_layer_hooks: list = []
        self.reset_stats()

    def fetch(self, layer: int, ids: list[int]):
        store = self.layers[layer]
        for e in ids:
            yield e, store[e]

    def pin(self, layer: int, ids: list[int]) -> None:
        """Everything is resident already: pinning moves nothing."""

    def resident(self, layer: int) -> set[int]:
        return set(range(self.num_experts))

    @property
    def bytes_moved(self) -> int:
        return 0

    def observe(self, layer: int, ids: torch.Tensor, counts: list[int]) -> None:
        row = self._counts[self.moe_layers.index(layer)]
        for e, c in enumerate(counts):
            row[e] += c

    def reset_stats(self) -> None:
        self._counts = [[0] * self.num_experts for _ in self.moe_layers]

    def stats(self) -> dict:
        return {"offload": "none", "bytes_moved": 0, "expert_counts": [list(r) for r in self._counts]}
