"""SpecMoE: self-assisted speculative decoding for offloaded MoE models (arXiv 2604.10152).

One **step** = one draft phase + one verification forward, batched over every active sequence:

1. draft (`draft`): the model restricted to its resident draft experts (`DraftExperts`) drafts
   γ_b tokens per sequence autoregressively. Each draft forward writes K/V at the sequence's
   next position; cache lengths are advanced while drafting and set back afterwards, so the
   draft's K/V at positions ≥ the committed length are scratch (overwritten by verification).
   The draft never calls the expert provider: zero backing-tier bytes.
2. verify (`verify`): ONE target forward over all B × (γ_b+1) positions (the pending token +
   the drafts), writing the target's K/V over the draft's; each MoE layer fetches the union of
   its experts once for the whole batch. Its routing counts refresh the HotTemporal draft set.
3. accept (`accept`): greedy and seeded sampled sequences in one pass: the longest draft prefix
   equal to the target's pick (argmax, or for seeded rows the Gumbel-max pick with the noise of
   that output position, see `sampling`) + the target's pick after it (correction/bonus). The
   seeded rule makes a seeded request's output independent of the draft and of its batch
   neighbours (equal to plain sampled decoding with the same seed). Unseeded sampled sequences use
   rejection sampling (`rejection.rejection_sample`, with the sequence's own generator), which
   accepts more. Commit accepted + 1 positions (the K/V of the pending token and of the accepted
   drafts); the emitted correction/bonus token is the new pending token.

`decoding="auto"` wraps the same step in a small cost model (`CostModel`) fed by measured
timings that picks speculation or a plain AR step per batch size.
"""
from __future__ import annotations

import math

import torch

from specmoe.decoding.breakdown import StepBreakdown, now
from specmoe.decoding.draft import DraftExperts
from specmoe.decoding.rejection import greedy_accept, rejection_sample
from specmoe.decoding.runner import ModelRunner
from specmoe.decoding.sampling import (check_finite, coupled_noise, coupled_pick, finite_rows, probs_from_logits,
                                       sample)
from specmoe.decoding.sequence import Sequence

# B=sequences, G=gamma (max drafted tokens this step), T=G+1 verified positions, V=vocab


@torch.inference_mode()
def draft(runner: ModelRunner, drafter: DraftExperts, seqs: list[Sequence], gammas: list[int],
          noise: dict[int, torch.Tensor] | None = None):
    """Draft gammas[b] tokens for each sequence: greedy rows take the argmax, seeded sampled rows b the
    coupled pick with `noise[b]` [γ_b+1, V], unseeded sampled rows draw from q with their own generator.
    Returns (draft ids [B, G] on the device, q [B, G, V] of the unseeded sampled rows or None when there
    are none). Cache lengths are unchanged on return."""
    cache, dev = runner.cache, runner.device
    noise = noise or {}
    B, G = len(seqs), max(gammas)
    out = torch.zeros(B, G, dtype=torch.long, device=dev)
    if G == 0:
        return out, None
    base = [cache.lengths[s.slot] for s in seqs]
    q = None
    tok = torch.tensor([[s.output_ids[-1]] for s in seqs], device=dev)  # [B, 1]
    ctx = drafter.context()
    try:
        for j in range(G):
            rows = [b for b in range(B) if gammas[b] > j]
            sub = [seqs[b] for b in rows]
            bv = runner.batch_view([s.slot for s in sub], [1] * len(sub))
            idx = None if len(rows) == B else torch.tensor(rows, device=dev)
            logits = runner.model(tok if idx is None else tok[idx], cache, bv, ctx)[:, -1].float()  # [b, V]
            nxt = logits.argmax(-1)  # [b]
            for i, b in enumerate(rows):
                s = seqs[b]
                if s.params.greedy:
                    continue
                if b in noise:
                    nxt[i] = coupled_pick(logits[i], s.params, noise[b][j])
                    continue
                if q is None:
                    q = torch.zeros(B, G, logits.shape[-1], device=dev)
                q[b, j] = probs_from_logits(logits[i], s.params)
                nxt[i] = torch.multinomial(q[b, j], 1, generator=s.generator)[0]
            if idx is None:
                out[:, j] = nxt
                tok = nxt[:, None]
            else:
                out[idx, j] = nxt
                tok = tok.clone()
                tok[idx, 0] = nxt
            for s in sub:
                runner.commit(s, 1)
    finally:
        for s, length in zip(seqs, base):
            runner.rollback(s, length)
        runner.expert_s += ctx.expert_s
    return out, q


def step_noise(seqs: list[Sequence], gammas: list[int], vocab: int, device) -> dict[int, torch.Tensor]:
    """Gumbel noise [γ_b+1, V] of the output positions a step may emit, for each seeded sampled row b."""
    return {b: coupled_noise(s.params.seed, len(s.output_ids), g + 1, vocab, device)
            for b, (s, g) in enumerate(zip(seqs, gammas)) if not s.params.greedy and s.params.seed is not None}


def verify(runner: ModelRunner, drafter: DraftExperts, seqs: list[Sequence], drafts: list[list[int]]):
    """One target forward over the pending token + drafts of every sequence → logits [B, T, V]."""
    ctx = drafter.target_context(runner.context())
    drafter.begin_target()
    try:
        return runner.forward(seqs, [[s.output_ids[-1]] + d for s, d in zip(seqs, drafts)], ctx=ctx,
                              all_logits=True)
    finally:
        drafter.end_target()


def accept(seqs: list[Sequence], drafts: torch.Tensor, q: torch.Tensor | None, logits: torch.Tensor,
           gammas: list[int], noise: dict[int, torch.Tensor] | None = None) -> list[list[int]]:
    """Tokens to emit per sequence (accepted drafts + correction/bonus). drafts [B, G], logits [B, T, V].
    Greedy rows and seeded sampled rows (`noise[b]` [γ_b+1, V]) in one vectorised pass of exact-match
    acceptance against the target's pick; unseeded sampled rows by rejection sampling against q [B, G, V]
    with their own generator."""
    noise = noise or {}
    B, dev = len(seqs), logits.device
    out: list[list[int]] = [[] for _ in range(B)]
    # a row is checked over the positions it verifies (padding positions of ragged rows are not)
    T = logits.shape[1]
    real = torch.arange(T, device=dev)[None, :] <= torch.tensor(gammas, device=dev)[:, None]  # [B, T]
    finite = (finite_rows(logits) | ~real).all(-1)  # [B]
    if not all(s.params.greedy or b in noise for b, s in enumerate(seqs)):
        check_finite(finite.tolist())  # before rejection sampling meets NaN
    tgt = logits.argmax(-1)  # [B, T]
    for b, n in noise.items():
        tgt[b, :gammas[b] + 1] = coupled_pick(logits[b, :gammas[b] + 1], seqs[b].params, n)
    exact = [b for b, s in enumerate(seqs) if s.params.greedy or b in noise]
    if exact:
        n_acc = greedy_accept(drafts, tgt[:, :drafts.shape[1] + 1], torch.tensor(gammas, device=dev))  # [B]
        d_l, t_l, n_l, ok = drafts.tolist(), tgt.tolist(), n_acc.tolist(), finite.tolist()  # one host read
        check_finite(ok)
        for b in exact:
            out[b] = d_l[b][:n_l[b]] + [t_l[b][n_l[b]]]
    for b, s in enumerate(seqs):
        if s.params.greedy or b in noise:
            continue
        G = gammas[b]
        p = probs_from_logits(logits[b, :G + 1], s.params)  # [G+1, V]
        if G == 0:
            out[b] = [int(torch.multinomial(p[0], 1, generator=s.generator))]
            continue
        n, nxt = rejection_sample(drafts[b:b + 1, :G], q[b:b + 1, :G], p[None], s.generator)
        k = int(n)
        out[b] = drafts[b, :k].tolist() + [int(nxt)]
    return out


class CostModel:
    """Picks `specmoe` or `ar` per batch size from measured step times (SpecMoE §fallback: at small
    batch a plain step can win). Per power-of-two batch bucket it keeps EMAs of the AR step time and
    of the speculative step time and τ, and compares seconds per token: t_ar vs (t_draft + t_verify) / τ.
    Unmeasured options are tried first; the losing option is re-measured now and then (the interval
    doubles while it keeps losing) so the estimates follow the workload."""

    def __init__(self, *, alpha: float = 0.3, explore_every: int = 16, max_explore_every: int = 256):
        self.alpha, self.explore0, self.explore_max = alpha, explore_every, max_explore_every
        self.buckets: dict[int, dict] = {}
        self.last_choice: str | None = None
        self.choices = {"ar": 0, "specmoe": 0}

    @staticmethod
    def bucket(B: int) -> int:
        return 1 << max(0, math.ceil(math.log2(max(B, 1))))

    def _b(self, B: int) -> dict:
        return self.buckets.setdefault(self.bucket(B), {"ar_s": None, "spec_s": None, "tau": None, "since": 0,
                                                         "every": self.explore0})

    def estimates(self, B: int) -> tuple[float | None, float | None]:
        """(AR seconds per token, SpecMoE seconds per token) at batch B, None where unmeasured."""
        e = self._b(B)
        ar = e["ar_s"]
        spec = e["spec_s"] / e["tau"] if e["spec_s"] is not None and e["tau"] else None
        return ar, spec

    def choose(self, B: int) -> str:
        e = self._b(B)
        ar, spec = self.estimates(B)
        if ar is None:
            choice = "ar"
        elif spec is None:
            choice = "specmoe"
        else:
            winner, loser = ("specmoe", "ar") if spec < ar else ("ar", "specmoe")
            e["since"] += 1
            choice = winner
            if e["since"] >= e["every"]:
                e["since"] = 0
                e["every"] = min(2 * e["every"], self.explore_max)
                choice = loser
        self.last_choice = choice
        self.choices[choice] += 1
        return choice

    def update(self, B: int, choice: str, step_s: float, tau: float | None = None) -> None:
        e = self._b(B)

        def ema(old, new):
            return new if old is None else (1 - self.alpha) * old + self.alpha * new
        if choice == "ar":
            e["ar_s"] = ema(e["ar_s"], step_s)
        else:
            e["spec_s"] = ema(e["spec_s"], step_s)
            e["tau"] = ema(e["tau"], tau)

    def stats(self) -> dict:
        table = {}
        for b, e in sorted(self.buckets.items()):
            ar, spec = self.estimates(b)
            table[b] = {"ar_s_per_token": ar, "specmoe_s_per_token": spec, "tau": e["tau"],
                        "choice": None if ar is None or spec is None else ("specmoe" if spec < ar else "ar")}
        return {"fallback_choice": self.last_choice, "fallback_steps": dict(self.choices), "cost_model": table}


class SpecMoEDecoder:
    """`decoding="specmoe"` (always speculate) or `"auto"` (cost model per batch)."""

    def __init__(self, runner: ModelRunner, drafter: DraftExperts, *, num_draft_tokens: int, max_model_len: int,
                 auto: bool = False):
        self.runner, self.drafter = runner, drafter
        self.gamma, self.max_model_len = num_draft_tokens, max_model_len
        self.name = "auto" if auto else "specmoe"
        self.cost = CostModel() if auto else None
        runner.observers.append(drafter.observe)
        self.steps = self.ar_steps = 0
        self.seq_steps = self.emitted = 0
        self.acc_pos = [0] * num_draft_tokens
        self.drafted_pos = [0] * num_draft_tokens
        self.draft_time = self.verify_time = self.accept_time = self.ar_time = 0.0
        self.draft_phase_bytes = 0
        self.breakdown = StepBreakdown()

    def _gamma_for(self, s: Sequence) -> int:
        """Never draft past what the sequence may still emit (max_tokens, context length)."""
        left = min(s.params.max_tokens - len(s.output_ids), self.max_model_len - s.num_tokens)
        return max(0, min(self.gamma, left - 1))

    def _bytes(self) -> int:
        return self.runner.provider.bytes_moved

    def step(self, seqs: list[Sequence]) -> dict[int, list[int]]:
        if self.cost is not None and self.cost.choose(len(seqs)) == "ar":
            return self._ar_step(seqs)
        return self._spec_step(seqs)

    @torch.inference_mode()
    def _ar_step(self, seqs: list[Sequence]) -> dict[int, list[int]]:
        """A plain AR step (same forward as AutoregressiveDecoder), seen by the draft-set observer."""
        dev, r = self.runner.device, self.runner
        t0 = now(dev)
        e0, w0, f0 = r.expert_s, r.provider.fetch_wait_s, self.drafter.refresh_s
        ctx = self.drafter.target_context(r.context())
        self.drafter.begin_target()
        try:
            logits = r.forward(seqs, [[s.output_ids[-1]] for s in seqs], ctx=ctx)  # [B, V]
        finally:
            self.drafter.end_target()
        for s in seqs:
            r.commit(s, 1)
        t1 = now(dev)
        toks = sample(logits, [s.params for s in seqs], [s.generator for s in seqs],
                      [len(s.output_ids) for s in seqs])
        dt = now(dev) - t0
        self.breakdown.target(t1 - t0, r.expert_s - e0, r.provider.fetch_wait_s - w0, self.drafter.refresh_s - f0)
        self.breakdown.accept(t0 + dt - t1)
        self.ar_steps += 1
        self.ar_time += dt
        if self.cost is not None:
            self.cost.update(len(seqs), "ar", dt)
        return {s.seq_id: [t] for s, t in zip(seqs, toks)}

    @torch.inference_mode()
    def _spec_step(self, seqs: list[Sequence]) -> dict[int, list[int]]:
        dev = self.runner.device
        if not self.drafter.ready:
            t = now(dev)
            self.drafter.setup()
            self.breakdown.setup(now(dev) - t)
        gammas = [self._gamma_for(s) for s in seqs]
        t0 = now(dev)
        r = self.runner
        e0, f0 = r.expert_s, self.drafter.refresh_s
        b0, p0 = self._bytes(), self.drafter.prefetch_bytes
        noise = step_noise(seqs, gammas, self.runner.model.cfg.vocab_size, dev)
        drafts, q = draft(self.runner, self.drafter, seqs, gammas, noise)
        # bytes the draft itself fetched (always 0: it computes from its own stacks); draft-guided
        # prefetch loads in the background for the verification and is counted apart
        self.draft_phase_bytes += self._bytes() - b0 - (self.drafter.prefetch_bytes - p0)
        d_list = drafts.tolist()
        t1 = now(dev)
        e1, w1 = r.expert_s, r.provider.fetch_wait_s
        logits = verify(self.runner, self.drafter, seqs, [d[:g] for d, g in zip(d_list, gammas)])  # [B, T, V]
        t2 = now(dev)
        out = accept(seqs, drafts, q, logits, gammas, noise)
        for s, toks in zip(seqs, out):
            self.runner.commit(s, len(toks))  # K/V of the pending token + the accepted drafts
        t3 = now(dev)
        self.breakdown.draft(t1 - t0, e1 - e0)
        self.breakdown.target(t2 - t1, r.expert_s - e1, r.provider.fetch_wait_s - w1, self.drafter.refresh_s - f0)
        self.breakdown.accept(t3 - t2)
        self.steps += 1
        self.draft_time += t1 - t0
        self.verify_time += t2 - t1
        self.accept_time += t3 - t2
        for toks, g in zip(out, gammas):
            self.seq_steps += 1
            self.emitted += len(toks)
            for j in range(g):
                self.drafted_pos[j] += 1
                if j < len(toks) - 1:
                    self.acc_pos[j] += 1
        if self.cost is not None:
            self.cost.update(len(seqs), "specmoe", t3 - t0, sum(len(t) for t in out) / len(out))
        return {s.seq_id: toks for s, toks in zip(seqs, out)}

    def stats(self) -> dict:
        st = {"decoding": self.name, "drafter": "self", "steps": self.steps, "ar_steps": self.ar_steps,
              "num_draft_tokens": self.gamma, "draft_experts": self.drafter.n,
              "substitution": self.drafter.substitution, "draft_policy": self.drafter.policy,
              "tokens_per_step": self.emitted / self.seq_steps if self.seq_steps else 0.0,
              "acceptance_per_position": [a / d if d else 0.0 for a, d in zip(self.acc_pos, self.drafted_pos)],
              "drafted_tokens": sum(self.drafted_pos), "accepted_tokens": sum(self.acc_pos),
              "draft_time_s": self.draft_time, "verify_time_s": self.verify_time, "accept_time_s": self.accept_time,
              "ar_time_s": self.ar_time, "draft_phase_bytes": self.draft_phase_bytes,
              "step_breakdown": dict(self.breakdown.s)}
        st.update(self.drafter.stats())
        if self.cost is not None:
            st.update(self.cost.stats())
        else:
            st["fallback_choice"] = "specmoe"
        return st
