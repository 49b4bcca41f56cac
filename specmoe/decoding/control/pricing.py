"""Pricing `auto`'s candidate plans over arrays (`Controller` mixes this in; its state is set up in
`Controller.__init__`): every candidate's draft phases, verification (expected expert union and misses over what is
resident) and the step's cost outside the model, from the one calibrated `CostModel`, on the drafters' acceptance
estimates (`learning.Acceptance`); each arm's (drafter or mix, chain or tree) best-priced candidate. The feedback
(`feedback.StepFeedback`) re-prices what a step really drafted with the same functions (`draft_raw`,
`verify_raw`)."""
from __future__ import annotations

import math

import numpy as np

from specmoe.decoding.control.candidates import Candidate, candidates, tree_extra, uniform
from specmoe.decoding.control.costmodel import bucket
from specmoe.decoding.control.plan import PricedArm, PricedPlain


class ArmPricing:
    """Prices plain and each candidate arm (`_price_plain`, `_candidates`, `_price`, `_tree_arms`) over the
    controller's `cost`, `accs`, `realized` and `outside` estimates."""

    def note_outside(self, B: int, seconds: float) -> None:
        """Fold in one step's cycle seconds outside what the model prices (`SpeculativeDecoder.step`): the plan,
        the controller's learning, the engine's loop between steps; an EMA per batch bucket."""
        if seconds >= 0:
            b, old = bucket(B), self.outside.get(bucket(B))
            self.outside[b] = seconds if old is None else 0.9 * old + 0.1 * seconds

    def outside_s(self, B: int) -> float:
        """Seconds a step at batch B spends outside what the model prices (nearest measured bucket; 0 before)."""
        if not self.outside:
            return 0.0
        b = bucket(B)
        return self.outside[b if b in self.outside else min(self.outside, key=lambda k: abs(math.log2(k / b)))]

    def _probs(self, name: str, seq_ids: list[int], avail: np.ndarray, optimism: float,
               calibrated: bool = True) -> np.ndarray:
        """[B, G] P_{b,j}: position estimate × the sequence's factor (× the plans' calibration k_j), non-increasing
        in j, 0 past what the row may draft."""
        acc = self.accs[name]
        P = acc.position(optimism)[None, :] * acc.seq_factor(seq_ids)[:, None]  # [B, G]
        if calibrated:
            P = P * acc.calibration()[None, :]
        P = np.minimum.accumulate(np.minimum(P, 1.0), axis=1)
        return np.where(np.arange(self.g)[None, :] < np.asarray(avail)[:, None], P, 0.0)

    def draft_rows(self, mine: np.ndarray, Gm: np.ndarray, catchup: np.ndarray | None) -> np.ndarray:
        """[C, G] rows each draft forward of a drafter computes, per candidate: the rows `mine` [C, B] still drafting
        at depth j; the first forward, padded to its longest catch-up (catchup [B] entries per row), runs
        rows · max entries."""
        G = max(int(Gm.max()), 1)
        rows = ((Gm[:, :, None] > np.arange(G)[None, None, :]) & mine[:, :, None]).sum(1)
        if catchup is not None:
            longest = np.where(mine, catchup[None, :], 0).max(1)
            rows[:, 0] *= np.maximum(longest, 1)
        return rows

    def draft_raw(self, name: str, mine: np.ndarray, Gm: np.ndarray, catchup: np.ndarray | None) -> np.ndarray:
        """[C] raw seconds of drafter `name`'s draft phase over its rows `mine` [C, B] (draft lengths Gm [C, B])."""
        return self.cost.drafter_time(name, self.draft_rows(mine, Gm, catchup)).sum(1)

    def verify_raw(self, B: int, Gm: np.ndarray, uses_self: np.ndarray, resident, spec_resident
                   ) -> tuple[np.ndarray, np.ndarray]:
        """The verification's pricing, the one the plans and the feedback share: raw seconds [C] and expected
        misses [C, L] of a forward over B pending tokens + Gm [C, B] drafts (rows padded to the longest), its
        experts' union over what is resident (with the self draft's set where `uses_self` [C])."""
        cm = self.cost
        eff = cm.effective(B, Gm.sum(1))
        u0, m0 = cm.expected_union(eff, resident, "spec")
        u1, m1 = cm.expected_union(eff, spec_resident, "spec")
        union, miss = np.where(uses_self[:, None], u1, u0), np.where(uses_self[:, None], m1, m0)
        return cm.forward_time(B + Gm.sum(1), union, miss, B * (1 + Gm.max(1))), miss

    def _costs(self, W: np.ndarray, Gm: np.ndarray, names: list[str], resident, spec_resident,
               setup: dict[str, float], catchup: dict[str, np.ndarray], nodes: np.ndarray | None = None
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per candidate c (W [C, B]: index into names of each row's drafter, Gm [C, B] its draft length; `nodes`
        [C, B]: the nodes each row verifies where that is more than its depth, a tree): raw draft s, raw verify s,
        refined total s and expected misses, each [C]."""
        cm = self.cost
        C, B = Gm.shape
        d_raw, d_ref, s_setup = np.zeros(C), np.zeros(C), np.zeros(C)
        uses_self = np.zeros(C, bool)
        for i, n in enumerate(names):
            mine = (W == i) & (Gm > 0)  # [C, B]
            if not mine.any():
                continue
            t = self.draft_raw(n, mine, Gm, catchup.get(n))
            d_raw += t
            d_ref += t * cm.ratio(f"draft:{n}", B)
            used = mine.any(1)
            s_setup += used * setup.get(n, 0.0)
            if n == "self":
                uses_self |= used
        Gv = Gm if nodes is None else nodes
        v, miss = self.verify_raw(B, Gv, uses_self, resident, spec_resident)
        n_tok, padded = B + Gv.sum(1), B * (1 + Gv.max(1))
        part, memo = cm.fwd(B), {}
        fwd = np.array([memo[b] if (b := bucket(int(k))) in memo else memo.setdefault(b, cm.ratio(part, int(k)))
                        for k in n_tok])
        return d_raw, v, d_ref + v * fwd + s_setup + cm.overhead("spec", B, padded), miss.sum(1)

    def _price_plain(self, B: int, resident: np.ndarray) -> PricedPlain:
        cm = self.cost
        t_raw, t = cm.plain_parts(B, resident)
        t += cm.overhead("plain", B)
        rate = B / (t * self.realized.slowdown("plain", B, self.steps) + self.outside_s(B))
        return PricedPlain(t_raw, t, rate, B / t)

    def _candidates(self, seq_ids: list[int], names: list[str], avail: dict[str, list[int]],
                    forced: bool) -> list[Candidate]:
        """Every distinct speculative plan (`candidates.candidates`); forced speculation: every row its full
        γ with the first drafter."""
        B = len(seq_ids)
        opt = self.optimism * np.sqrt(np.log(2.0 + self.steps))  # UCB: an arm left unused grows more optimistic
        # draft lengths come from unbiased acceptance; the upper-confidence estimate only decides which arms are
        # worth a trial (pruning)
        P = {n: self._probs(n, seq_ids, avail[n], 0.0) for n in names}
        Pu = {n: self._probs(n, seq_ids, avail[n], opt) for n in names}
        if forced:
            full = np.asarray(avail[names[0]]) if names else np.zeros(0, int)
            if not full.sum():
                return []
            on = np.arange(self.g)[None, :] < full[:, None]
            return [Candidate(names[0], np.zeros(B, int), full, float((P[names[0]] * on).sum()),
                              float((Pu[names[0]] * on).sum()), None)]
        c = candidates(names, P, Pu, avail, B, self.g)
        out = [Candidate(c.tags[i], c.W[i], c.Gm[i], float(c.gain[i]), float(c.gain_ucb[i]),
                         None if np.isnan(c.theta[i]) else float(c.theta[i])) for i in c.idx]
        return out + uniform(names, P, Pu, avail, B, self.g, self.SHORT)

    def _price(self, cands: list[Candidate], names: list[str], B: int, resident, spec_resident,
               setup: dict[str, float]) -> dict[str, PricedArm]:
        """The best-priced candidate of each arm (drafter or mix): its rate on unbiased estimates, corrected by
        what the arm's steps realized against such predictions, and the step's cost outside the model; at its
        steady draft (no catch-up: `Drafter.sync` is a switch's cost, which no measured rate counts either)."""
        if not cands:
            return {}
        W, Gm = np.stack([c.who for c in cands]), np.stack([c.gammas for c in cands])
        gains, ucb = np.array([c.gain for c in cands]), np.array([c.gain_ucb for c in cands])
        d_raw, v_raw, t, miss = self._costs(W, Gm, names, resident, spec_resident, setup, {})
        ext, tags = self.outside_s(B), np.array([c.tag for c in cands])
        out = {}
        for tag in dict.fromkeys(tags.tolist()):
            slow = self.realized.slowdown(tag, B, self.steps)
            mine = np.flatnonzero(tags == tag)
            i = int(mine[np.argmax((B + gains[mine]) / (t[mine] * slow + ext))])
            step = float(t[i]) * slow + ext
            out[tag] = PricedArm(cands[i], float(B + gains[i]) / step, float(B + ucb[i]) / step, float(d_raw[i]),
                                 float(v_raw[i]), float(t[i]) * slow, float(miss[i]), float(B + gains[i]) / t[i])
        if self.width > 1:
            out.update(self._tree_arms(out, names, B, resident, spec_resident, setup))
        return out

    def _tree_arms(self, chains: dict[str, PricedArm], names: list[str], B: int, resident, spec_resident,
                   setup: dict[str, float]) -> dict[str, PricedArm]:
        """Each drafter's tree arm ("eagle/tree"), on its chain arm's best per-row draft lengths: the tree verifies
        up to `width` nodes per depth, and at a depth where the chain's node is rejected a sibling may still be
        accepted (the node table's rank > 0 conditionals); one more accepted token at most per row."""
        out = {}
        for tag, arm in chains.items():
            if "+" in tag or tag not in names:  # single-drafter, full-depth chain arms only
                continue
            c = arm.cand
            extra = tree_extra(self.accs[tag], c.gammas, self.width)
            nodes = (c.gammas * self.width)[None]
            d_raw, v_raw, t, miss = self._costs(c.who[None], c.gammas[None], names, resident, spec_resident, setup,
                                                {}, nodes)
            name = tag + self.TREE
            slow = self.realized.slowdown(name, B, self.steps)
            step = float(t[0]) * slow + self.outside_s(B)
            cand = Candidate(name, c.who, c.gammas, c.gain + extra, c.gain_ucb + extra, c.theta)
            out[name] = PricedArm(cand, (B + cand.gain) / step, (B + cand.gain_ucb) / step, float(d_raw[0]),
                                  float(v_raw[0]), float(t[0]) * slow, float(miss[0]), (B + cand.gain) / float(t[0]))
        return out
