"""What `auto`'s controller learns online: acceptance per drafter (`Acceptance`: per draft position, per
sequence, by draft confidence) and the realized speed of each arm (`Realized`: tokens per second measured over
predicted, per arm — a plain step, or a speculative plan's drafter or drafter mix — and batch bucket), which
corrects whatever the step-time model and the acceptance estimates get wrong together for that arm."""
from __future__ import annotations

import numpy as np

from specmoe.decoding.control.costmodel import bucket

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

    def position(self, optimism: float = 0.0) -> np.ndarray:
        """P_j: probability that draft j is accepted, j = 0..γ_max-1 (non-increasing); with `optimism` c, the
        upper confidence estimate p + c·sqrt(p(1−p)/(n + w)) (n: drafts seen at j), so a drafter seen on few rows
        is tried until its estimate is measured rather than left at a pessimistic prior."""
        prior = self.prior ** np.arange(1, self.g + 1)
        n = self.drafted + self.w
        p = (self.acc + self.w * prior) / n
        if optimism:
            p = np.minimum(p + optimism * np.sqrt(p * (1 - p) / n), 1.0)
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


class Realized:
    """Realized / predicted tokens per second per (arm, batch bucket), as decayed sums (tokens over predicted
    tokens = seconds × the model's uncorrected rate), so one noisy step moves it little and a whole arm that the
    model mispredicts (a drafter slower or better than modelled) is corrected after a few steps of it."""

    DECAY = 0.85  # weight of the older steps at each new one (≈ the last 6-7 steps count)
    LO, HI = 0.25, 4.0

    def __init__(self):
        self.sums: dict[tuple[str, int], list[float]] = {}  # (arm, bucket) -> [tokens, predicted tokens, steps]

    def record(self, arm: str, B: int, tokens: float, seconds: float, raw_rate: float) -> None:
        if raw_rate <= 0 or seconds <= 0:
            return
        s = self.sums.setdefault((arm, bucket(B)), [0.0, 0.0, 0])
        s[0] = self.DECAY * s[0] + tokens
        s[1] = self.DECAY * s[1] + seconds * raw_rate
        s[2] += 1

    def steps(self, arm: str, B: int) -> int:
        s = self.sums.get((arm, bucket(B)))
        return s[2] if s else 0

    def ratio(self, arm: str, B: int) -> float:
        """This arm's correction at B's bucket; the nearest measured bucket's until measured; 1 before any."""
        b = bucket(B)
        s = self.sums.get((arm, b))
        if s is None:
            near = [k for k in self.sums if k[0] == arm]
            if not near:
                return 1.0
            s = self.sums[min(near, key=lambda k: abs(np.log2(k[1]) - np.log2(b)))]
        return float(min(max(s[0] / s[1], self.LO), self.HI))

    def stats(self) -> dict:
        return {f"{a}@{b}": round(s[0] / s[1], 4) for (a, b), s in sorted(self.sums.items()) if s[1] > 0}
