"""Comparisons with transformers' own models, shared by the family tests."""
from __future__ import annotations

import torch


def max_logit_diff(llm, hf, prompts) -> float:
    """Largest |ours - transformers| over the prompts' logits, ours batched (ragged) and one at a time."""
    batched = llm.logits(prompts)
    worst = 0.0
    for b, ids in enumerate(prompts):
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        worst = max(worst, (batched[b, :len(ids)] - ref).abs().max().item(),
                    (llm.logits([ids])[0] - ref).abs().max().item())
    return worst


def hf_greedy(hf, ids: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of `ids`, exactly n tokens."""
    with torch.no_grad():
        return hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           max_new_tokens=n, min_new_tokens=n, do_sample=False)[0, len(ids):].tolist()
