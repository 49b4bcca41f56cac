"""The engine's `decoding="auto"` controller, built on first use and kept in the LLM's `draft_memo`, so it keeps
refining its cost model and acceptance estimates across generate calls. Tests and benchmarks set its `force` /
`schedule`."""
from __future__ import annotations

from specmoe.decoding.strategies.factory import build_controller


def controller_of(llm):
    """`llm`'s controller (built once: calibration reads a few experts, or the cached coefficients)."""
    memo = llm.draft_memo
    if "controller" not in memo:
        memo["controller"] = build_controller(llm.model, llm.store, ckpt=llm.ckpt, spec=llm.spec_cfg,
                                              offload=llm.offload_cfg, dtype=llm.dtype, device=llm.device)
    return memo["controller"]
