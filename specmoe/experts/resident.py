"""All experts resident on the compute device: the reference every offloaded tier must equal."""
from __future__ import annotations

import torch
from tqdm import tqdm

from specmoe.errors import InputError
from specmoe.experts.buffers import expert_views
from specmoe.experts.formats import STORED
from specmoe.memory import round_up
from specmoe.experts.store import ExpertStore
from specmoe.models.moe import Routing, SlotGroup
from specmoe.weights.checkpoint import Checkpoint


class ResidentExperts(ExpertStore):
    """Every expert of every MoE layer packed in one [E, 3·I·D] tensor per layer: slot e holds expert e."""
    holds_all = True

    def __init__(self, ckpt: Checkpoint, dtype: torch.dtype, device: torch.device | str = "cpu",
                 progress: bool = False, reader=None, fmt=None):
        """`reader(layer, e, out)` fills one expert's row (quantized formats decode their stored bytes, or keep them
        as they are in a `STORED` row); default: the checkpoint's weights in `dtype`. `fmt`: the format whose stored
        bytes `STORED` (uint8) rows hold."""
        cfg = ckpt.config
        self.moe_layers = tuple(cfg.moe_layers)
        self.num_experts = cfg.num_experts
        self.layers: dict[int, torch.Tensor] = {}
        bar = tqdm(total=len(cfg.moe_layers) * cfg.num_experts, desc="experts", unit="exp", disable=not progress,
                   leave=False)
        for layer in cfg.moe_layers:
            # rows 64-byte aligned, like the cache's slots (the grouped matmul wants 16-byte strides)
            es = torch.empty(0, dtype=dtype).element_size()
            numel = fmt.stored_bytes if dtype == STORED else cfg.expert_numel
            stride = round_up(numel * es, 64) // es
            buf = torch.empty(cfg.num_experts, stride, dtype=dtype, device=device)[:, :numel]
            for e in range(cfg.num_experts):
                if reader is not None:
                    reader(layer, e, buf[e])
                else:
                    buf[e].copy_(ckpt.read_expert(layer, e, dtype))
                bar.update()
            self.layers[layer] = buf
        bar.close()
        self.nbytes = sum(t.numel() * t.element_size() for t in self.layers.values())
        self._views = {layer: fmt.stored_views(buf) if dtype == STORED else expert_views(buf, cfg)
                       for layer, buf in self.layers.items()}
        self._identity = torch.arange(cfg.num_experts + 1, device=device)  # slot e = expert e; E (padding) -> S
        self._groups = {layer: SlotGroup.over(views, self._identity, identity=True) for layer, views in self._views.items()}
        self.forward_observers: list = []  # counts accumulate on the device in fetch: no host read per layer
        self.forward_layer_hooks: list = []
        self.device = torch.device(device)
        self.reset_stats()

    def slot_tensors(self, layer: int) -> tuple:
        return self._views[layer]

    def slot_index(self, layer: int, ids: list[int]) -> list[int]:
        return [int(e) for e in ids]

    def fetch(self, layer: int, routing: Routing):
        """One group: every expert, slot e = expert e. The routed ids are kept and counted in batches on the
        device (no op and no host read per layer)."""
        pending = self._pending[layer]
        pending.append(routing.ids)  # [N, K]
        if len(pending) >= 64:
            self._fold(layer)
        yield self._groups[layer]

    def _fold(self, layer: int) -> None:
        pending = self._pending[layer]
        if pending:
            E = self.num_experts
            ids = torch.cat(pending).view(-1)
            self._counts[self.moe_layers.index(layer)] += torch.bincount(ids, minlength=E + 1)[:E]  # E: padding
            pending.clear()

    def pin(self, layer: int, ids: list[int]) -> None:
        """Everything is resident already: pinning moves nothing."""
        if any(not 0 <= e < self.num_experts for e in ids):
            raise InputError(f"cannot pin experts {list(ids)} of layer {layer}: ids must be in [0, {self.num_experts})")

    def resident(self, layer: int) -> set[int]:
        return set(range(self.num_experts))

    @property
    def bytes_moved(self) -> int:
        return 0

    def reset_stats(self) -> None:
        self._counts = torch.zeros(len(self.moe_layers), self.num_experts, dtype=torch.long,
                                   device=self.device)
        self._pending: dict[int, list[torch.Tensor]] = {layer: [] for layer in self.moe_layers}

    def stats(self) -> dict:
        for layer in self.moe_layers:
            self._fold(layer)
        per_expert = self.nbytes // (len(self.moe_layers) * self.num_experts)  # the slot size, as the cache reports it
        return {"offload": "none", "bytes_moved": 0, "expert_counts": self._counts.tolist(),
                "compute_bytes_per_expert": per_expert}
