"""MoE-Spec expert budget for verification (`verify_expert_budget=K`, LOSSY, opt-in).

A verification forward over B × (γ+1) tokens fetches, per MoE layer, the union of every token's top-k
experts, which grows with the batch and γ. The budget caps that union: per layer, the K experts with
the most routing mass over the forward's tokens (Σ of the top-k routing weights each receives), plus
every token's top-1 expert (so no token loses its first choice); every token then re-routes among that
set (its top-k of the router's probabilities restricted to the set, renormalised as the family does).
The verified logits are no longer the exact model's, so greedy output may differ from exact decoding:
report its effect (held-out NLL, greedy agreement) next to its speed.

Softmax top-k routers only (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): their re-routing is the router's own
rule restricted to a set, which is the rule SpecMoE's draft uses for `substitution="mask"`.
"""
from __future__ import annotations

import torch

from specmoe.errors import InputError
from specmoe.families import FAMILIES, family_of

# N=tokens, E=experts, K=top-k



def supported(model_type: str) -> bool:
    """A budget reroutes by the router's softmax: families whose router is softmax then top-k."""
    return family_of(model_type).router_kind == "softmax-topk"


def budget_set(weights: torch.Tensor, ids: torch.Tensor, num_experts: int, budget: int) -> torch.Tensor:
    """Allowed experts [E] bool: the `budget` experts of most routing mass + every token's top-1.
    weights [N, K] fp32 (ids[:, 0] is each token's top-1), ids [N, K]."""
    mass = torch.zeros(num_experts, device=ids.device).index_add_(0, ids.reshape(-1), weights.reshape(-1).float())
    allowed = torch.zeros(num_experts, dtype=torch.bool, device=ids.device)
    allowed[torch.topk(mass, min(budget, num_experts)).indices] = True
    allowed[ids[:, 0]] = True
    return allowed


def reroute(logits: torch.Tensor, allowed: torch.Tensor, top_k: int, normalize: bool):
    """Each token's top-k among the allowed experts, weights from the router's softmax over all experts
    (renormalised over the k when `normalize`). logits [N, E], allowed [E] → weights [N, K], ids [N, K]."""
    probs = torch.softmax(logits.float(), dim=-1).masked_fill(~allowed, 0.0)
    w, ids = torch.topk(probs, top_k, dim=-1)
    if normalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return w, ids


class ExpertBudget:
    """The routing hook of a budgeted verification forward, with its counters."""

    def __init__(self, cfg, budget: int):
        if not supported(cfg.model_type):
            names = ", ".join(f.model_type for f in FAMILIES.values() if f.router_kind == "softmax-topk")
            raise InputError(f"verify_expert_budget supports softmax top-k routers ({names}); "
                             f"{cfg.model_type} routes otherwise")
        if budget < cfg.top_k:
            raise InputError(f"verify_expert_budget={budget} must be at least the model's top-k ({cfg.top_k})")
        self.E, self.k, self.budget = cfg.num_experts, cfg.top_k, budget
        self.normalize = bool(cfg.norm_topk_prob)  # Mixtral's reader sets it: its router always renormalises
        self.assignments = self.rerouted = 0
        self.calls = self.union_exact = self.union_budget = 0  # (forward, layer) pairs; Σ experts used
        self.real: torch.Tensor | None = None  # [N] bool: the forward's non-padding tokens (set by the caller)

    def __call__(self, layer: int, logits: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor):
        real = self.real if self.real is not None and self.real.numel() == ids.shape[0] else None
        rw, rid = (weights, ids) if real is None else (weights[real], ids[real])  # padding neither counts nor votes
        allowed = budget_set(rw, rid, self.E, self.budget)
        inside = allowed[rid]  # [n, K]
        used = torch.zeros(self.E, dtype=torch.bool, device=ids.device)
        used[rid.reshape(-1)] = True
        n_used, n_out, all_in = int(used.sum()), int((~inside).sum()), bool(inside.all())
        self.assignments += rid.numel()
        self.calls += 1
        self.union_exact += n_used
        if all_in:
            self.union_budget += n_used
            return weights, ids
        w, new = reroute(logits, allowed, self.k, self.normalize)
        self.rerouted += n_out
        used.zero_()
        used[(new if real is None else new[real]).reshape(-1)] = True
        self.union_budget += int(used.sum())
        return w, new

    def stats(self) -> dict:
        return {"verify_expert_budget": self.budget, "budget_lossy": True,
                "budget_rerouted_share": self.rerouted / self.assignments if self.assignments else 0.0,
                "budget_experts_per_layer_exact": self.union_exact / self.calls if self.calls else 0.0,
                "budget_experts_per_layer_used": self.union_budget / self.calls if self.calls else 0.0}
