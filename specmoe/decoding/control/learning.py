"""What speculation learns online: acceptance per drafter (`Acceptance`: per draft depth and sibling rank, per
sequence, by draft confidence; one estimate that `auto`'s controller and the cost-aware tree selection both price
with, recorded once per step by the decoder; `ControllerMemory` carries it and the time corrections to the next
engine) and
what each arm's steps really take (`Realized`: measured over predicted step time, per arm — a plain step, or a speculative plan's
drafter or drafter mix — and batch bucket)."""
from __future__ import annotations

import json
import math
import os
from collections import deque

import numpy as np

from specmoe.decoding.control.refinement import bucket

CONF_BINS = 12  # over log10(confidence) in [-3, 0]: a head whose softmax is flat (confidences ~0.01) still
# spreads over bins


def conf_bin(conf: np.ndarray) -> np.ndarray:
    """The calibration bin of draft confidences (softmax probability of the drafted token)."""
    x = (np.log10(np.maximum(conf, 1e-3)) + 3.0) / 3.0
    return np.minimum((x * CONF_BINS).astype(int), CONF_BINS - 1)


PRIOR = {"self": 0.6, "eagle": 0.7, "ngram": 0.6}  # acceptance priors (weight 2) before anything is measured
RANKS = 16  # sibling ranks a node table keeps apart (draft_tree_width's most); wider ranks share the last


class Acceptance:
    """A drafter's acceptance, the one estimate both the controller's plans and the tree selection price with,
    decayed so it follows the workload. Its core is a node table: per depth and sibling rank (rank 0: the first
    child, i.e. the drafter's chain), how often a node was verified with its parent accepted (`reach`) and how often
    it was then accepted (`hit`): P(a node is accepted | its parent was), Beta-smoothed towards `prior`
    (`node_prob`). A chain's position estimate is the product along rank 0 (`position`). Beside it: per sequence
    (`seq_factor`), by the draft's own confidence (`by_confidence`) and the plans' calibration (`calibration`)."""

    def __init__(self, gamma_max: int, *, prior: float = 0.6, prior_weight: float = 2.0, decay: float = 1 / 256):
        self.g, self.prior, self.w, self.decay = gamma_max, prior, prior_weight, decay
        self.reach = np.zeros((gamma_max, RANKS))  # [depth-1, rank]: verified with the parent accepted
        self.hit = np.zeros((gamma_max, RANKS))    # ... and accepted
        self.drafted = np.zeros(gamma_max)  # rows whose draft reached depth j + 1
        self.conf_acc = np.zeros(CONF_BINS)  # conditional acceptance (all before accepted) by draft confidence
        self.conf_n = np.zeros(CONF_BINS)
        self.seq: dict[int, list[float]] = {}  # seq_id -> [accepted, drafted]
        # per position: drafts the controller's plans predicted accepted (Σ of their probabilities) and drafts
        # accepted, over the rows planned that deep (`record_plan`, `calibration`)
        self.plan_pred = np.zeros(gamma_max)
        self.plan_acc = np.zeros(gamma_max)

    @property
    def acc(self) -> np.ndarray:
        """[γ_max] rows whose node at depth j + 1 was accepted (at any rank)."""
        return self.hit.sum(1)

    def node_prob(self, depth: int, rank: int) -> float:
        """P(a node at this depth (1 = a child of the pending token) and sibling rank is accepted | its parent
        was): what the tree selection prices a node with."""
        d, k = min(depth, self.g) - 1, min(rank, RANKS - 1)
        return float((self.hit[d, k] + self.w * self.prior) / (self.reach[d, k] + self.w))

    def position(self, optimism: float = 0.0) -> np.ndarray:
        """P_j: probability that a chain's draft j is accepted, j = 0..γ_max-1: the product of the node table's
        rank-0 conditionals up to j (non-increasing); with `optimism` c, the upper confidence estimate
        p + c·sqrt(p(1−p)/(n + w)) (n: nodes seen at j with their parent accepted), so a drafter seen on few rows is
        tried until its estimate is measured rather than left at a pessimistic prior."""
        n = self.reach[:, 0] + self.w
        p = np.cumprod((self.hit[:, 0] + self.w * self.prior) / n)
        if optimism:
            p = np.minimum(p + optimism * np.sqrt(p * (1 - p) / n), 1.0)
        return np.minimum.accumulate(p)

    def rate(self) -> float:
        d = self.drafted.sum()
        return float((self.acc.sum() + self.w * self.prior) / (d + self.w))

    def conditional(self) -> float:
        """P(a draft is accepted | every draft before it in the row was): the chain nodes accepted over those
        reached (rank 0, every depth)."""
        return float((self.hit[:, 0].sum() + self.w * self.prior) / (self.reach[:, 0].sum() + self.w))

    PLAN_PRIOR = 8.0  # rows: k_j starts at 1 and follows what the plans' rows measured

    def calibration(self) -> np.ndarray:
        """k_j = drafts accepted / drafts predicted accepted at position j by recent plans (1 before any): what a
        plan's probabilities (position × the sequence's factor) still get wrong for the rows it plans that deep.
        Deep positions are drafted mostly by rows that looked good, so their position estimate, applied to every
        row and then scaled by the row's own factor, counts the good rows twice; k folds the bias back."""
        return np.clip((self.plan_acc + self.PLAN_PRIOR) / (self.plan_pred + self.PLAN_PRIOR), 0.25, 2.0)

    def record_plan(self, probs: np.ndarray, gammas: list[int], accepted: list[int]) -> None:
        """Fold in one step's planned rows: probs [R, γ_max] the probabilities the plan drafted them on (before
        `calibration`), gammas the planned draft lengths, accepted the drafts accepted."""
        keep = 1 - self.decay
        self.plan_pred *= keep
        self.plan_acc *= keep
        for p, g, n in zip(probs, gammas, accepted):
            self.plan_pred[:g] += p[:g]
            self.plan_acc[:min(n, g)] += 1

    @classmethod
    def of(cls, name: str, gamma_max: int) -> Acceptance:
        """Drafter `name`'s estimate, on its prior."""
        return cls(gamma_max, prior=PRIOR.get(name, 0.6))

    def forget(self, seq_ids) -> None:
        """Drop what was measured on these sequence ids (new sequences reuse ids of finished ones)."""
        for s in seq_ids:
            self.seq.pop(s, None)

    def seq_factor(self, seq_ids: list[int]) -> np.ndarray:
        g = self.rate()
        out = np.ones(len(seq_ids))
        for i, s in enumerate(seq_ids):
            a = self.seq.get(s)
            if a is not None:
                out[i] = (a[0] + 4 * g) / (a[1] + 4) / g
        return out

    def by_confidence(self, conf: np.ndarray) -> np.ndarray:
        """Conditional acceptance probability of drafts with these confidences (prior: the drafter's conditional
        acceptance, so an uncalibrated head's low confidences do not stop its drafts before anything is
        measured)."""
        b = conf_bin(np.asarray(conf))
        return (self.conf_acc[b] + 2 * self.conditional()) / (self.conf_n[b] + 2)

    def record(self, seq_ids: list[int], gammas: list[int], accepted: list[int], confidences: list[list[float]],
               trees=None, paths=None) -> None:
        """Fold in one step's rows of this drafter: gammas the depth each row's draft reached, accepted the drafts
        accepted, confidences the drafts' own confidences (may be empty); `trees` / `paths` (`DraftTree`s and the
        accepted forward rows, root 0 first) where rows branched, else each row is a chain of its gamma."""
        keep = 1 - self.decay
        for a in (self.reach, self.hit, self.drafted, self.conf_acc, self.conf_n):
            a *= keep
        for r, (s, g, n, conf) in enumerate(zip(seq_ids, gammas, accepted, confidences)):
            if g == 0:
                continue
            g = min(g, self.g)
            self.drafted[:g] += 1
            if trees is None or trees[r].is_chain:  # node j reached when all before it were accepted
                self.reach[:min(n + 1, g), 0] += 1
                self.hit[:min(n, g), 0] += 1
            else:
                on = set(paths[r])
                for i, (p, d, k) in enumerate(zip(trees[r].parents, trees[r].depths(), trees[r].ranks())):
                    if p + 1 in on and d <= self.g:
                        k = min(k, RANKS - 1)
                        self.reach[d - 1, k] += 1
                        self.hit[d - 1, k] += (i + 1) in on
            a = self.seq.setdefault(s, [0.0, 0.0])
            a[0], a[1] = 0.9 * a[0] + n, 0.9 * a[1] + g
            seen = conf[:min(g, n + 1)]  # observations conditional on all before accepted
            if seen:
                bins = conf_bin(np.asarray(seen))
                np.add.at(self.conf_n, bins, 1)
                np.add.at(self.conf_acc, bins, (np.arange(len(seen)) < n).astype(float))
        if len(self.seq) > 4096:
            live = set(seq_ids)
            self.seq = {s: v for s, v in self.seq.items() if s in live}

    def state(self) -> dict:
        """What `warm` reads back (JSON-ready)."""
        return {"reach": self.reach.tolist(), "hit": self.hit.tolist(), "drafted": self.drafted.tolist(),
                "conf_acc": self.conf_acc.tolist(), "conf_n": self.conf_n.tolist(),
                "plan_pred": self.plan_pred.tolist(), "plan_acc": self.plan_acc.tolist()}

    def warm(self, state: dict, rows: float) -> None:
        """Start from an earlier run's estimates (`state`), worth at most `rows` rows (per node and over the
        confidence bins), so this run's own rows soon outweigh them. Depths past the saved γ stay on the prior."""
        reach, hit = np.asarray(state["reach"], float), np.asarray(state["hit"], float)
        drafted = np.asarray(state["drafted"], float)
        k = min(self.g, len(reach), len(hit), len(drafted))
        if k and reach.ndim == hit.ndim == 2 and reach.shape[1] == hit.shape[1] == RANKS and reach[0, 0] > 0:
            f = min(1.0, rows / reach[0, 0])
            self.reach[:k], self.hit[:k], self.drafted[:k] = reach[:k] * f, hit[:k] * f, drafted[:k] * f
        ca, cn = np.asarray(state["conf_acc"], float), np.asarray(state["conf_n"], float)
        if len(ca) == len(cn) == CONF_BINS and cn.sum() > 0:
            f = min(1.0, rows / cn.sum())
            self.conf_acc, self.conf_n = ca * f, cn * f
        pp, pa = np.asarray(state.get("plan_pred", []), float), np.asarray(state.get("plan_acc", []), float)
        k = min(self.g, len(pp), len(pa))
        if k and pp[0] > 0:
            f = min(1.0, rows / pp[0])
            self.plan_pred[:k], self.plan_acc[:k] = pp[:k] * f, pa[:k] * f

    def node_table(self) -> list[list[float]]:
        """node_prob for every depth × the ranks seen (at least rank 0)."""
        width = max(1, int(np.flatnonzero(self.reach.sum(0) > 0).max(initial=0)) + 1)
        return [[self.node_prob(d + 1, k) for k in range(width)] for d in range(self.g)]

    def stats(self) -> dict:
        return {"acceptance_calibrated": self.position().tolist(), "acceptance_by_node": self.node_table(),
                "acceptance_plan_calibration": self.calibration().tolist(),
                "acceptance_by_confidence": [float(a / n) if n > 0.5 else None
                                             for a, n in zip(self.conf_acc, self.conf_n)]}


class ControllerMemory:
    """What an `auto` controller learned, kept across engines: one JSON file per machine + model + dtype + tier +
    drafter set (`<cache>/auto/<key>.json`) holding each drafter's acceptance (`Acceptance.warm`, worth `ROWS`
    rows) and the step-time corrections (`CostModel.warm`, `Realized.warm`: the refinement EMAs, ρ, each arm's
    measured / predicted time). A new engine starts from them instead of the generic priors, so its first requests
    do not pay to relearn what the last engine measured; its own steps soon outweigh them. Unreadable or foreign
    files are ignored; a read-only cache only loses the memory."""

    ROWS = 48.0  # what a remembered acceptance estimate weighs, in rows

    def __init__(self, key: str):
        from specmoe.decoding.control.costmodel import cache_root
        self.path = cache_root() / "auto" / f"{key}.json"
        self._data: dict | None = None

    def load(self) -> dict:
        if self._data is None:
            try:
                d = json.loads(self.path.read_text())
                self._data = d if isinstance(d, dict) else {}
            except (OSError, ValueError):
                self._data = {}
        return self._data

    def section(self, name: str) -> dict:
        d = self.load().get(name)
        return d if isinstance(d, dict) else {}

    def warm(self, accs: dict[str, Acceptance]) -> list[str]:
        """Warm each drafter's acceptance from the file → the drafters warmed."""
        done = []
        for name, st in self.section("acceptance").items():
            if name in accs and isinstance(st, dict):
                try:
                    accs[name].warm(st, self.ROWS)
                    done.append(name)
                except (KeyError, TypeError, ValueError):
                    continue
        return done

    def save(self, accs: dict[str, Acceptance], **sections: dict) -> None:
        self._data = {"acceptance": {n: a.state() for n, a in accs.items() if a.drafted[0] > 0}, **sections}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(self._data))
            tmp.replace(self.path)
        except OSError:
            pass


class Realized:
    """Measured / predicted seconds per emitted token per arm (a plain step, or a speculative plan's drafter or
    drafter mix) and batch bucket: what the arm's prediction (the refined step-time model and the unbiased
    acceptance estimates together) still gets wrong, e.g. a verify forward of many drafted rows on a loaded
    machine, or rows that accept less than their drafter's average: (Σ measured s / Σ predicted s) over the arm's
    last `WINDOW` steps at the bucket, leaving out stalls (a step over 4× the window's median: the machine, not the
    arm), times (Σ expected tokens / Σ emitted tokens) over its last `TOKEN_WINDOW` steps (ratios of sums: a mean
    of per-step ratios would overweight the steps that emitted one token; a longer window for the tokens, whose
    count each step draws by chance, so that near a tie the arms are not flipped by a few unlucky steps); counts
    from `MIN_STEPS` steps, and fades back to 1 over `FADE` steps in which the arm is not used (a correction
    measured under other load does not stick)."""

    WINDOW = 16
    TOKEN_WINDOW = 64
    MIN_STEPS = 3
    FADE = 256.0
    LO, HI = 0.25, 8.0

    def __init__(self):
        # (arm, bucket) -> (measured s, predicted s, emitted tokens, expected tokens) of recent steps
        self.win: dict[tuple[str, int], deque] = {}
        self.last: dict[tuple[str, int], int] = {}  # the step it was last measured at
        self.ratio: dict[tuple[str, int], float] = {}  # _of(key), recomputed when the key records a step

    def record(self, arm: str, B: int, measured_s: float, predicted_s: float, step: int,
               emitted: float = 1.0, expected: float = 1.0) -> None:
        if measured_s <= 0 or predicted_s <= 0 or emitted <= 0 or expected <= 0:
            return
        key = (arm, bucket(B))
        self.win.setdefault(key, deque(maxlen=self.TOKEN_WINDOW)).append((measured_s, predicted_s, emitted, expected))
        self.last[key] = step
        self.ratio[key] = self._of(key)

    def _of(self, key) -> float:
        w = list(self.win[key])  # a few dozen steps: plain Python beats numpy at this size
        recent = w[-self.WINDOW:]
        r = sorted(m / p for m, p, _, _ in recent)
        k = len(r)
        med = r[k // 2] if k % 2 else 0.5 * (r[k // 2 - 1] + r[k // 2])
        keep = [row for row in recent if row[0] / row[1] <= 4 * med]
        time_ratio = sum(row[0] for row in keep) / sum(row[1] for row in keep)
        token_ratio = sum(row[3] for row in w) / sum(row[2] for row in w)
        return min(max(time_ratio * token_ratio, self.LO), self.HI)

    def slowdown(self, arm: str, B: int, step: int) -> float:
        """Measured / predicted seconds of this arm at B's bucket (the nearest bucket with MIN_STEPS steps until
        this one has them; 1 before any), faded toward 1 by the steps since it was last measured."""
        b = bucket(B)
        key = (arm, b)
        if len(self.win.get(key, ())) < self.MIN_STEPS:
            near = [k for k, w in self.win.items() if k[0] == arm and len(w) >= self.MIN_STEPS]
            if not near:
                return 1.0
            key = min(near, key=lambda k: abs(np.log2(k[1]) - np.log2(b)))
        fade = math.exp(-(step - self.last[key]) / self.FADE)
        return 1.0 + (self.ratio[key] - 1.0) * fade

    def age(self, arm: str, B: int, step: int) -> float:
        """Steps since this arm was last measured at B's bucket (inf: never)."""
        last = self.last.get((arm, bucket(B)))
        return math.inf if last is None else step - last

    def measured_near(self, arm: str, B: int) -> bool:
        """Whether this arm has a step measured at B's bucket or at one next to it (half or double): a batch's
        ragged tail (4 sequences, then 3, 2, 1) needs no first trial at each size it passes through."""
        b = bucket(B)
        return any((arm, k) in self.win for k in (b // 2, b, 2 * b))

    def measured(self, arm: str, B: int) -> bool:
        """Whether this arm has a step measured at B's bucket."""
        return (arm, bucket(B)) in self.win

    def state(self) -> dict:
        return {f"{a}@{b}": self.ratio[(a, b)] for (a, b) in self.win}

    def warm(self, state: dict) -> None:
        """Start from remembered ratios (`state`), as MIN_STEPS steps measured at step 0: the arm's own steps
        replace them within a window, and unused they fade."""
        for k, r in state.items():
            try:
                arm, b = k.rsplit("@", 1)
                r = min(max(float(r), self.LO), self.HI)
                key = (arm, int(b))
            except (TypeError, ValueError):
                continue
            self.win[key] = deque([(r, 1.0, 1.0, 1.0)] * self.MIN_STEPS, maxlen=self.TOKEN_WINDOW)
            self.last[key], self.ratio[key] = 0, r

    def stats(self) -> dict:
        return {f"{a}@{b}": round(self._of((a, b)), 4) for (a, b) in sorted(self.win)}
