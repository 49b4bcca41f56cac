"""Verification rules as pure functions: greedy acceptance and speculative rejection sampling.

Rejection sampling is the rule of Leviathan et al. (2023) / Chen et al. (2023): accept the
draft token x with probability min(1, p(x)/q(x)); at the first rejection emit a token drawn
from norm(max(0, p − q)); when every draft token is accepted emit a bonus token drawn from
p at the next position. The emitted tokens are then distributed exactly as the target's.
p and q must come from the same filtering (`sampling.probs_from_logits`).
"""
from __future__ import annotations

import torch

# B=sequences, G=gamma (drafted tokens), V=vocab


def greedy_accept(draft_ids: torch.Tensor, target_ids: torch.Tensor, num_drafted: torch.Tensor) -> torch.Tensor:
    """Longest prefix of the drafts equal to the target's argmax.

    draft_ids [B, G], target_ids [B, G+1] (argmax of the target at each verified position),
    num_drafted [B] (drafts beyond it are padding) → accepted [B] in [0, num_drafted].
    The tokens to emit are draft_ids[b, :n] + [target_ids[b, n]] (correction, or bonus when n = G)."""
    G = draft_ids.shape[1]
    pos = torch.arange(G, device=draft_ids.device)[None, :]
    match = (draft_ids == target_ids[:, :G]) & (pos < num_drafted[:, None])  # [B, G]
    return match.long().cumprod(dim=1).sum(dim=1)


def rejection_sample(draft_ids: torch.Tensor, q: torch.Tensor, p: torch.Tensor, generator: torch.Generator | None,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling over B independent rows (one generator for all of them).

    draft_ids [B, G] drawn from q [B, G, V]; p [B, G+1, V] the target's probabilities at the
    G drafted positions and the one after. Returns (accepted [B] in [0, G], next_token [B]): emit
    draft_ids[b, :accepted[b]] + [next_token[b]] (recovered token, or bonus when all accepted).
    Draws G uniforms and one categorical sample per row."""
    B, G = draft_ids.shape
    dev = p.device
    u = torch.rand(B, G, generator=generator, device=dev)  # [B, G]
    idx = draft_ids[..., None]
    p_x = p[:, :G].gather(-1, idx)[..., 0]  # [B, G]
    q_x = q.gather(-1, idx)[..., 0]
    accept = u * q_x <= p_x  # u < min(1, p/q) without dividing by q
    n = accept.long().cumprod(dim=1).sum(dim=1)  # [B]
    rows = torch.arange(B, device=dev)
    p_n = p[rows, n]  # [B, V] target at the first rejected position (or the bonus position)
    q_pad = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)  # [B, G+1, V]: no draft at the bonus position
    resid = (p_n - q_pad[rows, n]).clamp_min(0)
    mass = resid.sum(-1, keepdim=True)
    # p ≥ q everywhere only when p = q, and then nothing is ever rejected; guard the 0/0 of rounding
    resid = torch.where(mass > 0, resid / mass.clamp_min(1e-30), p_n)
    nxt = torch.multinomial(resid, 1, generator=generator)[:, 0]
    return n, nxt
