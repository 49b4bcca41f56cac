"""The candidate speculative plans of one step, as arrays: a pure function of the acceptance estimates. For each
threshold θ on P (a row drafts while its running acceptance probability stays ≥ θ), and for "everything
available", each capped at every common depth (a verification's rows are padded to its longest one, so a
uniform depth can beat a ragged one that expects a few more tokens), every drafter alone, and each model drafter
mixed with each lookup drafter (a row takes whichever expects more accepted tokens). The controller prices them
(`Controller._costs`) and picks one."""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

THETAS = np.array([0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.12, 0.06])
LOOKUP = ("ngram",)  # drafters whose proposal is known before the step (free to make)


@dataclass
class Candidate:
    """One speculative plan: its arm (drafter or mix), each row's drafter (index into the planned names) and draft
    length, expected accepted tokens (unbiased, upper-confidence) and the in-draft stopping threshold (None: none)."""
    tag: str
    who: np.ndarray      # [B]
    gammas: np.ndarray   # [B]
    gain: float
    gain_ucb: float
    theta: float | None


@dataclass
class Candidates:
    W: np.ndarray         # [C, B] index into `names` of each row's drafter
    Gm: np.ndarray        # [C, B] each row's draft length
    gain: np.ndarray      # [C] expected accepted tokens (unbiased estimates)
    gain_ucb: np.ndarray  # [C] the same on upper-confidence estimates
    theta: np.ndarray     # [C] the in-draft stopping threshold (nan: everything available, no stopping)
    tags: list[str]       # [C] the drafter (mix) of each candidate, e.g. "eagle+ngram"
    idx: np.ndarray       # the distinct candidates that draft something, the highest θ of each


def candidates(names: list[str], P: dict[str, np.ndarray], Pu: dict[str, np.ndarray],
               avail: dict[str, list[int]], B: int, G: int) -> Candidates:
    """P[d], Pu[d] [B, G]: drafter d's unbiased / upper-confidence probability that row b's j-th draft is
    accepted (all before it accepted); avail[d][b]: the most d may draft for row b."""
    ar = np.arange(G)
    K = (len(THETAS) + 1) * G  # thresholds θ, then "everything available", under each cap G, G-1, .., 1
    Ls, gains, ucb = {}, {}, {}
    for n in names:  # draft lengths [K, B] and expected accepted tokens [K, B] per threshold and cap
        L = np.concatenate([(P[n][None] >= THETAS[:, None, None]).sum(-1), np.asarray(avail[n])[None]])
        Ls[n] = np.concatenate([np.minimum(L, cap) for cap in range(G, 0, -1)])
        drafts = ar[None, None, :] < Ls[n][:, :, None]
        gains[n] = (P[n][None] * drafts).sum(-1)
        ucb[n] = (Pu[n][None] * drafts).sum(-1)
    Ws, Gs, Ns, Us, tags = [], [], [], [], []
    for i, n in enumerate(names):
        Ws.append(np.full((K, B), i))
        Gs.append(Ls[n])
        Ns.append(gains[n])
        Us.append(ucb[n])
        tags += [n] * K
        for j, k in enumerate(names):
            if n in LOOKUP or k not in LOOKUP:
                continue
            take = (gains[k] >= gains[n]) & (Ls[k] > 0)  # rows the lookup serves better
            Ws.append(np.where(take, j, i))
            Gs.append(np.where(take, Ls[k], Ls[n]))
            Ns.append(np.where(take, gains[k], gains[n]))
            Us.append(np.where(take, ucb[k], ucb[n]))
            tags += [f"{n}+{k}"] * K
    W, Gm = np.concatenate(Ws), np.concatenate(Gs)
    theta = np.tile(np.append(THETAS, np.nan), len(Ws) * G)
    keep = np.flatnonzero(Gm.sum(1) > 0)
    rows = np.ascontiguousarray(np.concatenate([np.where(Gm > 0, W, -1), Gm], 1)[keep])
    first: dict[bytes, int] = {}
    for i, r in zip(keep.tolist(), rows):  # a dict of row bytes: np.unique over rows costs ~10× more here
        first.setdefault(r.tobytes(), i)
    idx = np.array(sorted(first.values()), dtype=int)  # distinct plans, the highest θ of each
    return Candidates(W, Gm, np.concatenate(Ns).sum(1), np.concatenate(Us).sum(1), theta, tags, idx)


def tree_extra(acc, gammas: np.ndarray, width: int) -> float:
    """Expected accepted tokens a tree of `width` branches per depth adds over its chain (the drafter's estimate
    `acc`, a `learning.Acceptance`; rows drafting gammas[b] deep): at the depth where the chain's node is rejected,
    one of its siblings may be accepted, P = 1 − Π_k (1 − P(rank k accepted | parent accepted)), k = 1..width−1."""
    G = acc.g
    q0 = np.array([acc.node_prob(d + 1, 0) for d in range(G)])
    sib = 1 - np.prod([[1 - acc.node_prob(d + 1, k) for k in range(1, width)] for d in range(G)], axis=1)
    reach = np.concatenate([[1.0], acc.position()[:-1]])  # P(the chain reached depth j + 1)
    extra = np.cumsum(reach * (1 - q0) * sib)  # [G]: what a row drafting j + 1 deep gains
    return float(sum(extra[g - 1] for g in np.asarray(gammas, int) if g > 0))


def is_uniform(tag: str) -> bool:
    """Whether an arm is a fixed configuration (`uniform`'s "eagle-g2"): one drafter, one length for every row, no
    stopping threshold; nothing in its plan goes stale while the same sequences decode."""
    return "-g" in tag


@functools.lru_cache(maxsize=256)
def uniform_parts(tag: str) -> tuple[str, int]:
    """A fixed configuration's drafter and draft length ("eagle-g2" -> ("eagle", 2)); cached (a reused call reads
    it every step)."""
    d, g = tag.rsplit("-g", 1)
    return d, int(g)


def uniform(names: list[str], P: dict[str, np.ndarray], Pu: dict[str, np.ndarray], avail: dict[str, list[int]],
            B: int, G: int, short: int) -> list[Candidate]:
    """The fixed configurations as plans: drafter d drafting every row g tokens ("eagle-g2"; g = `short` and G),
    as far as each row may, with no stopping threshold: what decoding="specmoe" with that drafter and
    num_draft_tokens does, so auto measures the configurations a user would otherwise pick by hand beside its
    per-row plans ("eagle": lengths priced per row)."""
    out = []
    for i, n in enumerate(names):
        for g in sorted({min(short, G), G}):
            gam = np.minimum(np.asarray(avail[n]), g)
            if gam.sum():
                on = np.arange(G)[None, :] < gam[:, None]
                out.append(Candidate(f"{n}-g{g}", np.full(B, i), gam, float((P[n] * on).sum()),
                                     float((Pu[n] * on).sum()), None))
    return out
