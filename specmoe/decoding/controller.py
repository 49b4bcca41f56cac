"""When to speculate: `decoding="auto"`'s per-step choice between a plain step and speculation with a
draft length γ_b per sequence (0..γ_max), chosen to maximise predicted tokens per second

    rate = (B + Σ_b Σ_{j<γ_b} P_bj) / T(γ)

(the chain case of cost-aware draft selection), where T comes from the calibrated `CostModel` and P_bj,
the probability that sequence b's draft j is accepted (all drafts before it accepted), from acceptance
calibrated online: per draft position (`Acceptance.position`), scaled by the sequence's own recent
acceptance. Candidate plans are the thresholds θ on P_bj (a sequence drafts while P_bj ≥ θ), plus plain.

While drafting, each greedy sequence's running P is updated from the draft's own confidence (its softmax
probability of the drafted token, mapped to an acceptance probability calibrated online by confidence
bin), and the sequence stops drafting once the running P falls below the plan's θ (the next token's
expected gain per second below the step's rate) or the confidence below `p_min`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from specmoe.decoding.costmodel import CostModel

THETAS = np.array([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.12, 0.06])
CONF_BINS = 10


class Acceptance:
    """Online acceptance statistics, decayed so they follow the workload."""

    def __init__(self, gamma_max: int, *, prior: float = 0.6, prior_weight: float = 2.0, decay: float = 1 / 256):
        self.g, self.prior, self.w, self.decay = gamma_max, prior, prior_weight, decay
        self.acc = np.zeros(gamma_max)      # steps in which draft j was accepted
        self.drafted = np.zeros(gamma_max)  # steps that drafted position j
        self.conf_acc = np.zeros(CONF_BINS)  # conditional acceptance (all before accepted) by draft confidence
        self.conf_n = np.zeros(CONF_BINS)
        self.seq: dict[int, list[float]] = {}  # seq_id -> [accepted, drafted]

    def position(self) -> np.ndarray:
        """P_j: probability that draft j is accepted, j = 0..γ_max-1 (non-increasing)."""
        prior = self.prior ** np.arange(1, self.g + 1)
        p = (self.acc + self.w * prior) / (self.drafted + self.w)
        return np.minimum.accumulate(p)

    def rate(self) -> float:
        d = self.drafted.sum()
        return float((self.acc.sum() + self.w * self.prior) / (d + self.w))

    def seq_factor(self, seq_ids: list[int]) -> np.ndarray:
        g = self.rate()
        out = np.ones(len(seq_ids))
        for i, s in enumerate(seq_ids):
            a = self.seq.get(s)
            if a is not None:
                out[i] = (a[0] + 4 * g) / (a[1] + 4) / g
        return out

    def by_confidence(self, conf: np.ndarray) -> np.ndarray:
        """Conditional acceptance probability of drafts with these confidences (prior: the confidence)."""
        b = np.minimum((conf * CONF_BINS).astype(int), CONF_BINS - 1)
        return (self.conf_acc[b] + 2 * conf) / (self.conf_n[b] + 2)

    def record(self, seq_ids: list[int], gammas: list[int], accepted: list[int],
               confidences: list[list[float]]) -> None:
        keep = 1 - self.decay
        self.acc *= keep
        self.drafted *= keep
        self.conf_acc *= keep
        self.conf_n *= keep
        for s, g, n, conf in zip(seq_ids, gammas, accepted, confidences):
            if g == 0:
                continue
            self.drafted[:g] += 1
            self.acc[:n] += 1
            a = self.seq.setdefault(s, [0.0, 0.0])
            a[0], a[1] = 0.9 * a[0] + n, 0.9 * a[1] + g
            for j, c in enumerate(conf[:min(g, n + 1)]):  # observations conditional on all before accepted
                b = min(int(c * CONF_BINS), CONF_BINS - 1)
                self.conf_n[b] += 1
                self.conf_acc[b] += j < n
        if len(self.seq) > 4096:
            live = set(seq_ids)
            self.seq = {s: v for s, v in self.seq.items() if s in live}

    def stats(self) -> dict:
        return {"acceptance_calibrated": self.position().tolist(),
                "acceptance_by_confidence": [float(a / n) if n > 0.5 else None
                                             for a, n in zip(self.conf_acc, self.conf_n)]}


@dataclass
class Plan:
    kind: str                    # "plain" | "spec"
    gammas: list[int] | None     # per sequence (spec)
    theta: float                 # in-draft stopping threshold on the running acceptance probability
    predicted_s: float           # refined prediction of the chosen step
    raw_s: float                 # before the time refinement
    predicted_misses: float
    plain_rate: float            # predicted tokens/s of the plain step and of the best speculative plan
    spec_rate: float
    reason: str = "model"        # "model" | "forced" | "schedule" | "explore"
    spec_gammas: list[int] | None = None  # the best speculative plan's γ_b, chosen or not
    draft_raw_s: float = 0.0     # the chosen speculative step's raw draft and verification predictions
    verify_raw_s: float = 0.0
    verify_tokens: int = 0


class Controller:
    """Chooses each step (module docstring). `force` ("plain" / "spec", None = choose) and `schedule` (a
    callable step index -> "plain" / "spec") override the choice, for tests and benchmarks; forced speculation
    drafts every sequence's full γ (what decoding="specmoe" does) but for the p_min floor (0 turns it off)."""

    def __init__(self, cost: CostModel, gamma_max: int, *, p_min: float = 0.05, explore_every: int = 64):
        self.cost, self.g = cost, gamma_max
        self.acc = Acceptance(gamma_max)
        self.p_min, self.explore_every = p_min, explore_every
        self.force: str | None = None
        self.schedule = None
        self.steps = self.stops = 0
        self.since_spec = 0
        self.coasting = (0, 0)  # (batch size, steps left) of a plain call reused without planning
        self.coast_steps, self.coast_below = 3, 0.8
        # speculate only on a predicted gain of this margin: near a tie the noisier, setup-paying choice loses
        self.spec_margin = 1.1
        self.choices = {"plain": 0, "spec": 0}
        self.reasons: dict[str, int] = {}

    def coast(self, B: int) -> bool:
        """True when this step repeats the last plain call without planning: after a plan that chose plain by a
        clear margin (or forced plain), the next `coast_steps` steps at the same batch size do (the
        controller's own cost stays a small share of a plain step)."""
        b, left = self.coasting
        if b != B or left <= 0 or self.schedule is not None:
            self.coasting = (0, 0)
            return False
        self.coasting = (b, left - 1)
        self.steps += 1
        self.since_spec += 1
        self.choices["plain"] += 1
        self.reasons["coast"] = self.reasons.get("coast", 0) + 1
        return True

    def plan(self, seq_ids: list[int], limits: list[int], resident: np.ndarray, spec_resident: np.ndarray,
             setup_s: float = 0.0) -> Plan:
        """`limits[b]`: the most sequence b may draft; `resident` / `spec_resident` [L, E]: resident experts for
        a plain step / a speculative one (with the draft set); `setup_s`: seconds a speculative step would
        first spend making the draft set resident."""
        B = len(seq_ids)
        lim = np.asarray(limits)
        cm = self.cost
        t_plain_raw, t_plain = cm.plain_parts(B, resident)
        plain_rate = B / t_plain
        P = self.acc.position()[None, :] * self.acc.seq_factor(seq_ids)[:, None]  # [B, G]
        P = np.minimum.accumulate(np.minimum(P, 1.0), axis=1)
        P = np.where(np.arange(self.g)[None, :] < lim[:, None], P, 0.0)
        cands = np.concatenate([(P[None] >= THETAS[:, None, None]).sum(-1), lim[None]])  # [C, B]
        gain = np.array([(P * (np.arange(self.g)[None, :] < c[:, None])).sum() for c in cands])
        d_raw, v_raw, t_spec = cm.spec_parts(cands, spec_resident)
        t_spec = t_spec + setup_s  # making the draft set resident first (its first step, or after a plain stretch)
        rates = (B + gain) / t_spec
        rates[cands.sum(1) == 0] = 0.0  # a speculative step that drafts nothing is a plain step
        i = int(np.argmax(rates))
        spec_rate = float(rates[i])
        want = None
        if self.schedule is not None:
            want, reason = self.schedule(self.steps), "schedule"
        elif self.force is not None:
            want, reason = self.force, "forced"
        if want == "spec":
            i = len(cands) - 1  # every sequence its full γ
        if want is None:
            reason = "model"
            want = "spec" if spec_rate > self.spec_margin * plain_rate else "plain"
            if (want == "plain" and cands[i].sum() > 0 and self.since_spec >= self.explore_every
                    and spec_rate >= 0.9 * plain_rate):
                want, reason = "spec", "explore"  # keep the acceptance estimates alive near the break-even
        self.steps += 1
        self.choices[want] += 1
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        if want == "plain" or cands[i].sum() == 0:
            self.since_spec += 1
            if reason == "forced" or (reason == "model" and spec_rate < self.coast_below * plain_rate):
                self.coasting = (B, self.coast_steps)  # a clear call: the next steps reuse it without planning
            _, miss = cm.expected_union(np.array([B]), resident, "plain")
            return Plan("plain", None, 1.0, t_plain, t_plain_raw, float(miss.sum()), plain_rate, spec_rate, reason,
                        cands[i].astype(int).tolist())
        self.since_spec = 0
        raw = float(d_raw[i] + v_raw[i])
        _, miss = cm.expected_union(np.array([B + cands[i].sum()]), spec_resident, "spec")
        theta = 0.0 if reason in ("forced", "schedule") else float(THETAS[i]) if i < len(THETAS) else 0.0
        return Plan("spec", cands[i].astype(int).tolist(), theta, float(t_spec[i]), raw, float(miss.sum()),
                    plain_rate, spec_rate, reason, cands[i].astype(int).tolist(), float(d_raw[i]), float(v_raw[i]),
                    int(B + cands[i].sum()))

    def stopper(self, plan: Plan, seqs, gammas: list[int]):
        """The draft's `on_logits` hook for this step: records each greedy row's confidence and stops it once
        its running acceptance probability falls below the plan's θ or its confidence below p_min.
        Returns (hook, confidences per sequence)."""
        conf: list[list[float]] = [[] for _ in seqs]
        run = np.ones(len(seqs))
        greedy = [s.params.greedy for s in seqs]
        theta = plan.theta if plan.reason not in ("forced", "schedule") else 0.0  # forced: the p_min floor only

        def hook(j: int, rows: list[int], logits: torch.Tensor) -> None:
            c = torch.softmax(logits, dim=-1).amax(-1).tolist()  # the draft's own confidence, one host read
            cs = np.asarray(c)
            run[rows] *= self.acc.by_confidence(cs)
            for i, b in enumerate(rows):
                conf[b].append(c[i])
                if greedy[b] and gammas[b] > j + 1 and (c[i] < self.p_min or run[b] < theta):
                    gammas[b] = j + 1
                    self.stops += 1
        return hook, conf

    def stats(self) -> dict:
        return {"controller_steps": dict(self.choices), "controller_reasons": dict(self.reasons),
                "controller_draft_stops": self.stops,
                "controller_p_min": self.p_min, **self.acc.stats(), **self.cost.stats()}
