"""Online corrections of the step-time model (`costmodel.CostModel`): what its calibrated coefficients still get
wrong on this machine under this load, folded in from measured steps.

- Target forwards at one batch bucket: measured / predicted seconds as a line in x = log2(tokens per row)
  (`RatioFit`). A verification at batch 1 of 4 tokens and a plain step at batch 4 are different forwards for the
  model's error, and within a batch bucket the error grows with the drafted tokens (the lm_head and the grouped
  expert matmuls of a small batch cost more per extra row than the calibration's shapes say): a line in x
  prices each draft length apart, where a ratio per token-count bucket priced 3 and 4 tokens alike and so
  favoured the longest drafts each bucket holds.
- Other parts (each drafter's draft phase, by batch bucket): an EMA of the ratio.
- Misses (per step kind) and the host time outside the forwards (per computed token and batch bucket): EMAs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field


def bucket(B: int) -> int:
    """The power of two at or above B (1 for B ≤ 1): the batch bucket estimates are kept per."""
    return 1 << (max(int(B), 1) - 1).bit_length()


@dataclass
class RatioFit:
    """measured / predicted seconds y of one part's forwards as a + b·x, x = log2(tokens) − log2(batch bucket):
    exponentially weighted least squares (the newest observation weighs 1, one `DECAY`^k steps older), the slope
    shrunk toward 0 (a ridge of `RIDGE` observations' worth) while the x's seen barely differ, and x clamped to
    half a doubling past the range seen (no extrapolation from a line fitted on one point)."""
    DECAY = 0.95
    RIDGE = 0.5
    w: float = 0.0
    sx: float = 0.0
    sxx: float = 0.0
    sy: float = 0.0
    sxy: float = 0.0
    lo: float = math.inf
    hi: float = -math.inf

    def add(self, x: float, y: float) -> None:
        d = self.DECAY
        self.w, self.sx, self.sxx = d * self.w + 1, d * self.sx + x, d * self.sxx + x * x
        self.sy, self.sxy = d * self.sy + y, d * self.sxy + x * y
        self.lo, self.hi = min(self.lo, x), max(self.hi, x)

    def line(self) -> tuple[float, float]:
        """(a, b) of y = a + b·x."""
        mx, my = self.sx / self.w, self.sy / self.w
        b = (self.sxy - self.w * mx * my) / (self.sxx - self.w * mx * mx + self.RIDGE)
        return my - b * mx, b

    def at(self, x: float) -> float:
        a, b = self.line()
        x = min(max(x, self.lo - 0.5), self.hi + 0.5)
        return min(max(a + b * x, 0.05), 20.0)

    def state(self) -> list[float]:
        return [self.w, self.sx, self.sxx, self.sy, self.sxy, self.lo, self.hi]

    @classmethod
    def of(cls, s) -> "RatioFit":
        w, sx, sxx, sy, sxy, lo, hi = (float(v) for v in s)
        if not (w > 0 and math.isfinite(lo) and math.isfinite(hi) and lo <= hi):
            raise ValueError("not a fit")
        return cls(w, sx, sxx, sy, sxy, lo, hi)


@dataclass
class Refinement:
    """The online corrections (module docstring)."""
    alpha: float = 0.25
    FADE = 32.0  # refinements of a part after which a bucket not re-measured has mostly faded to its freshest one
    fits: dict = field(default_factory=dict)  # "fwd/<batch bucket>" -> RatioFit
    time: dict = field(default_factory=dict)  # (part, batch bucket) -> EMA ratio (draft phases)
    seen: dict = field(default_factory=dict)  # (part, bucket) → the part's refinement count when last measured
    count: dict = field(default_factory=dict)  # part → refinements so far
    misses: dict = field(default_factory=dict)
    overhead: dict = field(default_factory=dict)  # (kind, batch bucket) → seconds per computed token a step spends
    # outside its forwards

    def ema(self, table: dict, key, ratio: float) -> None:
        ratio = min(max(ratio, 0.05), 20.0)
        old = table.get(key)
        table[key] = ratio if old is None else (1 - self.alpha) * old + self.alpha * ratio

    @staticmethod
    def x(part: str, n: int) -> float:
        """A forward part's regressor: log2 of its tokens per row of its batch bucket."""
        return math.log2(max(n, 1)) - math.log2(int(part[4:]))

    def refine(self, part: str, n: int, ratio: float) -> None:
        """Fold in one measured / predicted ratio of `part` over n tokens (a forward) or at batch n (a draft)."""
        ratio = min(max(ratio, 0.05), 20.0)
        if part.startswith("fwd/"):
            self.fits.setdefault(part, RatioFit()).add(self.x(part, n), ratio)
            return
        self.ema(self.time, (part, bucket(n)), ratio)
        self.count[part] = self.count.get(part, 0) + 1
        self.seen[(part, bucket(n))] = self.count[part]

    def ratio(self, part: str, n: int) -> float | None:
        """The correction of `part` at n (None: nothing measured for it): a forward part from its own fit or, never
        measured at this batch bucket, the nearest measured batch bucket's at the same tokens per row; a draft
        part at n's bucket, else its nearest measured bucket."""
        if part.startswith("fwd/"):
            if not self.fits:
                return None
            at = math.log2(int(part[4:]))
            near = part if part in self.fits else min(self.fits, key=lambda k: (abs(math.log2(int(k[4:])) - at), k))
            return self.fits[near].at(self.x(part, n))
        b = bucket(n)
        if (part, b) in self.time:
            return self._faded(part, b)
        near = [k for k in self.time if k[0] == part]
        if near:
            return self._faded(*min(near, key=lambda k: (abs(math.log2(k[1]) - math.log2(b)), k[1])))
        return None

    def _faded(self, part: str, b: int) -> float:
        """The part's ratio at bucket b, faded toward its most recently measured bucket's by the part's
        refinements since b was measured: a correction measured under other load (the machine's speed drifts)
        does not stick to a bucket the controller stopped choosing because of it."""
        age = self.count.get(part, 0) - self.seen.get((part, b), 0)
        if age <= 0:
            return self.time[(part, b)]
        fresh = max((k for k in self.time if k[0] == part), key=lambda k: self.seen.get(k, 0))
        w = math.exp(-age / self.FADE)
        return w * self.time[(part, b)] + (1 - w) * self.time[fresh]

    def state(self) -> dict:
        return {"time": [[k, b, v] for (k, b), v in self.time.items()],
                "fwd_fit": {k: f.state() for k, f in self.fits.items()},
                "overhead_per_token": [[k, b, v] for (k, b), v in self.overhead.items()], "misses": dict(self.misses)}

    def warm(self, state: dict) -> None:
        """Start from remembered refinements (a `state`; malformed entries are skipped)."""
        for name, table in (("time", self.time), ("overhead_per_token", self.overhead)):
            for row in state.get(name, []):
                try:
                    k, b, v = row
                    if not str(k).startswith("fwd/"):  # forwards: fits (an older memory's ratios are dropped)
                        table[(str(k), int(b))] = float(v)
                except (TypeError, ValueError):
                    continue
        for k, s in (state.get("fwd_fit") or {}).items():
            try:
                if str(k).startswith("fwd/"):
                    int(str(k)[4:])
                    self.fits[str(k)] = RatioFit.of(s)
            except (TypeError, ValueError):
                continue
        for k, v in (state.get("misses") or {}).items():
            if isinstance(v, (int, float)):
                self.misses[str(k)] = float(v)

    def stats(self) -> dict:
        """time_refinement: the draft parts' ratios per bucket; fwd_refinement: each forward fit's line and range."""
        fits = {}
        for k, f in sorted(self.fits.items(), key=lambda kv: int(kv[0][4:])):
            a, b = f.line()
            fits[k] = {"a": a, "b": b, "x_lo": f.lo, "x_hi": f.hi}
        return {"time_refinement": {f"{k}@{b}": v for (k, b), v in sorted(self.time.items())},
                "fwd_refinement": fits}
