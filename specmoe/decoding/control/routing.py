"""Recent routing, as the cost model reads it: per-layer EMA of how often each expert is picked per token, fed by
the target forwards' routing counts (a ForwardContext observer), and the last forward's observed union."""
from __future__ import annotations

import numpy as np
import torch


class RoutingStats:
    """Per-layer EMA of p_e = how often expert e is picked per token (Σ_e p_e = top-k), from the target
    forwards' routing counts (a ForwardContext observer)."""

    def __init__(self, layers: list[int], num_experts: int, top_k: int, alpha: float = 0.3):
        self.layers, self.alpha, self.top_k = list(layers), alpha, top_k
        self.index = {layer: i for i, layer in enumerate(self.layers)}
        self.p = np.full((len(self.layers), num_experts), top_k / num_experts)
        self.pending: dict[int, list[int]] = {}
        self.union_seen: dict[int, int] = {}
        self._hot: dict[int, np.ndarray] = {}  # hottest(n), until the next flush changes p
        # the last flushed forward: (tokens routed per layer, union summed over layers, p before it was folded in)
        self.last: tuple[float, float, np.ndarray] | None = None

    def observe(self, layer: int, routing) -> None:
        self.pending[layer] = routing.counts  # [E] on the device: read to the host once per flush, not per layer

    def flush(self) -> None:
        """Fold the counts seen since the last flush into the EMA."""
        if not self.pending:
            return
        idx = [self.index[layer] for layer in self.pending]
        c = torch.stack(list(self.pending.values())).double().cpu().numpy()  # [l, E]: one host read
        n = c.sum(1, keepdims=True) / self.top_k  # tokens routed (each picks top-k experts)
        self.last = (float(n.mean()), float((c > 0).sum()), self.p[idx].copy())
        self.p[idx] = (1 - self.alpha) * self.p[idx] + self.alpha * np.minimum(c / np.maximum(n, 1e-9), 1.0)
        self.pending = {}
        self._hot = {}

    def hottest(self, n: int) -> np.ndarray:
        """[L, E] mask of each layer's n most picked experts (read-only)."""
        if n in self._hot:
            return self._hot[n]
        order = np.argsort(-self.p, axis=1, kind="stable")[:, :n]
        m = np.zeros_like(self.p, dtype=bool)
        np.put_along_axis(m, order, True, axis=1)
        self._hot[n] = m
        return m
