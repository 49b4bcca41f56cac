"""Cost-aware draft lengths for proposals that cost nothing to make (`draft_selection="cost"`).

A lookup drafter proposes up to γ tokens for free, but every proposed token costs a verified position.
Per step, the verified set is chosen with `selection.select` (SpecFit's objective (B + Σ P(v)) / T(S),
chains as the special case): P(v) from the acceptance measured so far at each draft depth (conditional on
the previous draft's acceptance, Beta(1, 1) prior), T(S) from a least-squares fit of the measured
verification time against the number of verified positions (t ≈ a + c·positions, exponentially
forgotten; every 8th step verifies everything, so the fit keeps seeing long verifications). Each row
keeps the prefix of its proposal that the selection picks (possibly none).
Lossless: this only shortens proposals.
"""
from __future__ import annotations

from specmoe.decoding.selection import DraftNode, VerifyCost, select


class ChainSelector:
    MIN_STEPS = 4  # steps measured before the fit is trusted (until then every proposal is verified)
    EXPLORE_EVERY = 8  # every 8th step verifies every proposal, so the fit keeps seeing long verifications

    def __init__(self, gamma: int, *, forget: float = 0.98):
        self.reach = [0.0] * gamma  # times depth j was verified with its parent accepted
        self.acc = [0.0] * gamma    # ... and accepted
        self.forget = forget
        self.n = self.sx = self.sy = self.sxx = self.sxy = 0.0  # weighted sums of (positions, seconds)
        self.steps = self.cut = self.calls = 0  # steps fitted; proposed tokens left out; choose() calls

    def probs(self) -> list[float]:
        return [(a + 1.0) / (r + 2.0) for a, r in zip(self.acc, self.reach)]

    def cost(self) -> tuple[float, float] | None:
        """(a, c) of t ≈ a + c·positions, None while it cannot be fitted (too few steps, no spread)."""
        if self.steps < self.MIN_STEPS:
            return None
        var = self.n * self.sxx - self.sx * self.sx
        if var <= 1e-12 * max(1.0, self.n * self.sxx):
            return None
        c = (self.n * self.sxy - self.sx * self.sy) / var
        a = (self.sy - c * self.sx) / self.n
        return (a, c) if c > 0 and a + c > 0 else None

    def choose(self, gammas: list[int]) -> list[int]:
        """Draft lengths to verify (each ≤ gammas[b]) for rows with gammas[b] proposed tokens."""
        fit = self.cost()
        self.calls += 1
        if fit is None or not any(gammas) or self.calls % self.EXPLORE_EVERY == 0:
            return list(gammas)
        a, c = fit
        p = self.probs()
        nodes, row_of = [], []
        for b, g in enumerate(gammas):
            for j in range(g):
                nodes.append(DraftNode(seq=b, parent=len(nodes) - 1 if j else -1, p=p[j]))
                row_of.append(b)
        B = len(gammas)
        S = select(nodes, B, VerifyCost(base_s=max(a + c * B, 1e-9), token_s=c))
        out = [0] * B
        for i in S:
            out[row_of[i]] += 1
        self.cut += sum(gammas) - sum(out)
        return out

    def record(self, gammas: list[int], accepted: list[int], positions: int, seconds: float) -> None:
        """One step's outcome: rows verified gammas[b] drafts and accepted accepted[b]; the verification
        forward covered `positions` positions in `seconds`."""
        for g, n in zip(gammas, accepted):
            for j in range(min(g, n + 1)):
                self.reach[j] += 1
                self.acc[j] += j < n
        f = self.forget
        self.n, self.sx, self.sy = f * self.n + 1, f * self.sx + positions, f * self.sy + seconds
        self.sxx, self.sxy = f * self.sxx + positions * positions, f * self.sxy + positions * seconds
        self.steps += 1

    def stats(self) -> dict:
        fit = self.cost()
        return {"draft_selection": "cost", "selection_cut_tokens": self.cut,
                "selection_accept_probs": self.probs(),
                "selection_cost_fit": None if fit is None else {"base_s": fit[0], "per_position_s": fit[1]}}
