"""Expert activation profiles: which experts a model's router picks, per MoE layer.

A profile is `expert_profile.json` = {"counts": [[per expert] per MoE layer], "skewness":
[per layer], ...} (a bare list of lists is read too). The static cache policy (MoE-Caching)
keeps each layer's hottest ~10% experts resident; `specmoe profile` writes a profile and a
heatmap (SpecMoE Fig. 6).
"""
from __future__ import annotations

import json
import math
import warnings
from pathlib import Path

import torch

from specmoe.config import ModelConfig
from specmoe.errors import CheckpointError

BUILTIN_PROMPTS = (
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "The history of the Roman Empire begins with",
    "Question: What is the capital of France?\nAnswer:",
    "import numpy as np\n\nclass Matrix:\n    def __init__(self, rows):",
    "Once upon a time, in a small village by the sea, there lived",
    "The derivative of x squared is 2x because",
    "SELECT name, count(*) FROM users GROUP BY name ORDER BY",
    "Dear team,\nThank you for your work on the release. Next week we will",
)

HOT_SHARE = 0.10  # MoE-Caching keeps the hottest ~10% experts per layer


def skewness(counts: list[int]) -> float:
    """Share of routed assignments covered by the hottest 25% of a layer's experts (SpecMoE Table I)."""
    c = sorted(counts, reverse=True)
    k = max(1, len(c) // 4)
    return sum(c[:k]) / max(1, sum(c))


def load_profile(path: Path, cfg: ModelConfig) -> list[list[int]]:
    """Counts per MoE layer (rows may be given per MoE layer or per decoder layer)."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:  # ValueError: bad JSON or not UTF-8
        raise CheckpointError(f"cannot read expert profile {path}: {e}") from None
    rows = raw.get("counts") if isinstance(raw, dict) else raw
    if not isinstance(rows, list) or not all(isinstance(r, list) for r in rows):
        raise CheckpointError(f"expert profile {path}: expected {{'counts': [[...] per layer]}} or a list of lists")
    if len(rows) == cfg.num_layers and len(rows) != len(cfg.moe_layers):
        rows = [rows[layer] for layer in cfg.moe_layers]
    if len(rows) != len(cfg.moe_layers) or any(len(r) != cfg.num_experts for r in rows):
        raise CheckpointError(f"expert profile {path} has shape {len(rows)}×{len(rows[0]) if rows else 0}; the model "
                              f"has {len(cfg.moe_layers)} MoE layers × {cfg.num_experts} experts")
    for i, r in enumerate(rows):
        for e, c in enumerate(r):
            if not _count(c):
                raise CheckpointError(f"expert profile {path}: counts[{i}][{e}] is {json.dumps(c)[:40]}; each count must be "
                                      "an integer >= 0")
    return [[int(c) for c in r] for r in rows]


def _count(c) -> bool:
    """A routed-assignment count: a non-negative integer (3.0 as a writer may print it counts too)."""
    if isinstance(c, bool):
        return False
    if isinstance(c, int):
        return c >= 0
    return isinstance(c, float) and math.isfinite(c) and c.is_integer() and c >= 0


def profile_fingerprint(path: Path) -> str | None:
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None
    return raw.get("fingerprint") if isinstance(raw, dict) else None


def hot_experts(counts: list[list[int]], cfg: ModelConfig, share: float = HOT_SHARE) -> dict[int, list[int]]:
    """The hottest ceil(share·E) experts of each MoE layer, hottest first."""
    n = max(1, math.ceil(share * cfg.num_experts))
    return {layer: sorted(range(cfg.num_experts), key=lambda e: (-row[e], e))[:n]
            for layer, row in zip(cfg.moe_layers, counts)}


def profile_dict(counts: list[list[int]], cfg: ModelConfig, **meta) -> dict:
    return {"counts": counts, "skewness": [round(skewness(r), 4) for r in counts],
            "moe_layers": list(cfg.moe_layers), "num_experts": cfg.num_experts, "top_k": cfg.top_k, **meta}


def default_token_lists(path: Path, cfg: ModelConfig, prompts=BUILTIN_PROMPTS) -> list[list[int]]:
    from specmoe.tokenizer import Tokenizer
    tok = Tokenizer.load(path)
    if tok is not None:
        lists = [[t for t in tok.encode(p) if t < cfg.vocab_size] for p in prompts]
        return [t for t in lists if t]
    g = torch.Generator().manual_seed(0)  # no tokenizer: seeded pseudo-random ids
    return [torch.randint(0, cfg.vocab_size, (32,), generator=g).tolist() for _ in prompts]


@torch.inference_mode()
def collect_counts(model, store, token_lists: list[list[int]], *, device: torch.device,
                   dtype: torch.dtype) -> list[list[int]]:
    """Prefill each token list alone (no padding to pollute the counts) and count routed assignments."""
    from specmoe.models.decoder import BatchView
    from specmoe.models.kv_cache import make_cache
    from specmoe.models.moe import ForwardContext
    cfg = model.cfg
    counts = [[0] * cfg.num_experts for _ in cfg.moe_layers]

    def obs(layer, routing):
        row = counts[cfg.moe_layers.index(layer)]
        for e, n in enumerate(routing.counts_host):
            row[e] += n
    ctx = ForwardContext(provider=store, observers=[obs])
    for toks in token_lists:
        toks = toks[: cfg.max_position_embeddings]
        T = len(toks)
        cache = make_cache(cfg, max_batch=1, max_seq=T, dtype=dtype, device=device, sources=False)
        bv = BatchView(slots=torch.zeros(1, dtype=torch.long, device=device),
                       positions=torch.arange(T, device=device)[None], contiguous=slice(0, 1), key_len=T)
        model(torch.tensor([toks], device=device), cache, bv, ctx,
              logits_at=torch.full((1, 1), T - 1, device=device))
    return counts


def save_profile(path: Path, profile: dict) -> bool:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(profile))
        tmp.replace(path)
        return True
    except OSError as e:
        warnings.warn(f"could not cache the expert profile at {path}: {e.strerror or e}", stacklevel=2)
        return False


def heatmap(counts: list[list[int]], cfg: ModelConfig, out: Path, title: str = "") -> Path:
    """Activation share per (MoE layer, expert), like SpecMoE Fig. 6."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    share = torch.tensor(counts, dtype=torch.float64)
    share = share / share.sum(1, keepdim=True).clamp(min=1)
    fig, ax = plt.subplots(figsize=(max(4.0, 0.25 * cfg.num_experts + 2), max(3.0, 0.3 * len(counts) + 1.5)))
    im = ax.imshow(share.numpy(), aspect="auto", cmap="viridis", interpolation="nearest")
    ax.set_xlabel("expert")
    ax.set_ylabel("MoE layer")
    ax.set_yticks(range(len(counts)), [str(layer) for layer in cfg.moe_layers])
    ax.set_title(title or "expert activation share per layer")
    fig.colorbar(im, ax=ax, label="share of routed assignments")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out
