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

`decoding="auto"` asks a controller (`controller.py`, over the calibrated `costmodel.py`) each step for a
plain step or speculation with a draft length per sequence, whichever it predicts emits more tokens/s.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from specmoe.decoding.breakdown import SpecTally, StepBreakdown, now
from specmoe.decoding.controller import Controller
from specmoe.decoding.draft import DraftExperts
from specmoe.decoding.rejection import greedy_accept, rejection_sample
from specmoe.decoding.runner import ModelRunner
from specmoe.decoding.sampling import (check_finite, coupled_noise, coupled_pick, finite_rows, probs_from_logits,
                                       sample)
from specmoe.decoding.sequence import Sequence

# B=sequences, G=gamma (max drafted tokens this step), T=G+1 verified positions, V=vocab


@torch.inference_mode()
def draft(runner: ModelRunner, drafter: DraftExperts, seqs: list[Sequence], gammas: list[int],
          noise: dict[int, torch.Tensor] | None = None, on_logits=None):
    """Draft gammas[b] tokens for each sequence: greedy rows take the argmax, seeded sampled rows b the
    coupled pick with `noise[b]` [γ_b+1, V], unseeded sampled rows draw from q with their own generator.
    Returns (draft ids [B, G] on the device, q [B, G, V] of the unseeded sampled rows or None when there
    are none). Cache lengths are unchanged on return. `on_logits(j, rows, logits [len(rows), V])`, when
    given, sees each draft position and may lower `gammas[b]` (in place) to j+1 for greedy rows b in rows:
    those rows stop drafting after this token (the controller's stopping rule)."""
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
            if not rows:
                break
            sub = [seqs[b] for b in rows]
            bv = runner.batch_view([s.slot for s in sub], [1] * len(sub))
            idx = None if len(rows) == B else torch.tensor(rows, device=dev)
            logits = runner.model(tok if idx is None else tok[idx], cache, bv, ctx, flat=True)  # [b, V]
            logits = logits if logits.dtype == torch.float32 else logits.float()
            drafter.forwards += 1
            nxt = logits.argmax(-1)  # [b]
            if on_logits is not None:
                on_logits(j, rows, logits)
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


def verify(runner: ModelRunner, drafter: DraftExperts, seqs: list[Sequence], drafts: torch.Tensor,
           gammas: list[int]):
    """One target forward over the pending token + the first gammas[b] drafts of every sequence (drafts [B, G]
    on the device; the input is built there, no host read) → logits [B, T, V]."""
    G = max(gammas)
    pending = torch.tensor([[s.output_ids[-1]] for s in seqs], device=drafts.device)  # [B, 1]
    tokens = torch.cat([pending, drafts[:, :G]], 1) if G else pending  # [B, G + 1]
    drafter.begin_target()
    try:
        return runner.forward_padded(seqs, tokens, [g + 1 for g in gammas], all_logits=True)
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
        G = drafts.shape[1]
        n_acc = greedy_accept(drafts, tgt[:, :G + 1], torch.tensor(gammas, device=dev))  # [B]
        # one host read: drafts [B, G] | target picks [B, T] | accepted [B] | finite [B]
        rows = torch.cat([drafts, tgt, n_acc[:, None], finite[:, None].long()], 1).tolist()
        check_finite([r[-1] == 1 for r in rows])
        for b in exact:
            r, n = rows[b], rows[b][-2]
            out[b] = r[:n] + [r[G + n]]
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


class SpecMoEDecoder:
    """`decoding="specmoe"` (always speculate, γ per sequence) or `"auto"` (`controller` given: each step
    plain or speculative with per-sequence γ_b, see `controller.py`)."""

    DORMANT_AFTER = 8  # consecutive plain steps after which auto unpins the draft set (plain = AR's cache)

    def __init__(self, runner: ModelRunner, drafter: DraftExperts, *, num_draft_tokens: int, max_model_len: int,
                 controller: Controller | None = None):
        self.runner, self.drafter = runner, drafter
        self.gamma, self.max_model_len = num_draft_tokens, max_model_len
        self.ctl = controller
        self.name = "auto" if controller is not None else "specmoe"
        runner.observers.append(drafter.observe)
        if controller is not None:
            runner.observers.append(controller.cost.routing.observe)
        self.last_counts: dict[int, list[int]] = {}
        if drafter.prefetch:
            runner.observers.append(self._observe)
        self.ar_steps = 0
        self.tally = SpecTally(num_draft_tokens)
        self.ar_time = 0.0
        self.controller_s = 0.0
        self.draft_phase_bytes = 0
        self.breakdown = StepBreakdown()
        # (kind, B, predicted s, raw predicted s, measured s, predicted plain tok/s, best speculative tok/s)
        self.predictions: list[tuple] = []
        self.plain_run, self.dormant, self.unpins = 0, False, 0
        self.last_parts, self.last_setup = (0.0, 0.0), False
        if controller is not None:
            # a draft set pinned by an earlier run stays pinned in the cache; auto's plain steps need the slots
            for layer in drafter.cfg.moe_layers:
                runner.provider.pin(layer, [])
        self.pf = {"tp": 0, "fp": 0, "fn": 0}  # draft-guided prefetch picks vs what verification needed

    def _observe(self, layer: int, routing) -> None:
        self.last_counts[layer] = routing.counts_host  # draft-guided prefetch only: a cache reads it anyway

    def _gamma_for(self, s: Sequence) -> int:
        """Never draft past what the sequence may still emit (max_tokens, context length)."""
        left = min(s.params.max_tokens - len(s.output_ids), self.max_model_len - s.num_tokens)
        return max(0, min(self.gamma, left - 1))

    def _bytes(self) -> int:
        return self.runner.provider.bytes_moved

    def step(self, seqs: list[Sequence]) -> dict[int, list[int]]:
        limits = [self._gamma_for(s) for s in seqs]
        if self.ctl is None:
            return self._spec_step(seqs, limits)
        t = time.perf_counter()
        if self.ctl.coast(len(seqs)):
            self.controller_s += time.perf_counter() - t
            return self._plain_step(seqs)
        plan = self._plan(seqs, limits)
        self.controller_s += time.perf_counter() - t
        dev = self.runner.device
        b0 = self._bytes()
        t0 = now(dev)
        if plan.kind == "plain":
            out = self._plain_step(seqs)
        else:
            out = self._spec_step(seqs, plan.gammas, plan)
        dt = now(dev) - t0
        cm = self.ctl.cost
        cm.refine_misses(plan.kind, (self._bytes() - b0) / cm.c.expert_bytes, plan.predicted_misses)
        if plan.kind == "plain":
            cm.refine("fwd", len(seqs), dt, plan.raw_s)
        else:  # the setup of a draft set is not a draft phase: refine from steps without one
            d, v = self.last_parts
            if not self.last_setup:
                cm.refine("draft", len(seqs), d, plan.draft_raw_s)
            cm.refine("fwd", plan.verify_tokens, v, plan.verify_raw_s)
        if len(self.predictions) < 20000:
            self.predictions.append((plan.kind, len(seqs), plan.predicted_s, plan.raw_s, dt, plan.plain_rate,
                                     plan.spec_rate))
        return out

    def _plan(self, seqs: list[Sequence], limits: list[int]):
        cm, cfg = self.ctl.cost, self.drafter.cfg
        cm.routing.flush()
        store = self.runner.provider
        res = np.zeros((len(cfg.moe_layers), cfg.num_experts), dtype=bool)
        for i, layer in enumerate(cfg.moe_layers):
            res[i, list(store.resident(layer))] = True
        if self.drafter.ready:
            spec_res = res.copy()
            for i, layer in enumerate(cfg.moe_layers):
                spec_res[i, self.drafter.ids[layer]] = True
        else:
            spec_res = res | cm.routing.hottest(self.drafter.n)
        setup = 0.0
        if not self.drafter.ready or self.dormant:  # the draft set's experts not resident now load first
            setup = float((spec_res & ~res).sum()) * cm.c.read_s + cm.c.read_latency_s * len(cfg.moe_layers)
        return self.ctl.plan([s.seq_id for s in seqs], limits, res, spec_res, setup)

    # ------------------------------------------------------------ draft set residency on plain stretches
    def _unpin(self) -> None:
        """A long plain stretch: give the draft set's cache slots back (they are pinned again, and their experts
        fetched where evicted, before the next draft phase)."""
        for layer in self.drafter.cfg.moe_layers:
            self.runner.provider.pin(layer, [])
        self.dormant, self.unpins = True, self.unpins + 1

    def _repin(self) -> None:
        self.drafter.repin()  # the draft reads its experts in place: they must be resident, in known slots
        self.dormant = False

    @torch.inference_mode()
    def _plain_step(self, seqs: list[Sequence]) -> dict[int, list[int]]:
        """A plain step: the same forward as AutoregressiveDecoder, without the draft set's observer (no
        draft-set maintenance), so it costs what an AR step costs."""
        dev, r = self.runner.device, self.runner
        t0 = now(dev)
        e0, w0 = r.expert_s, r.provider.fetch_wait_s
        ctx = r.context()
        ctx.observers = [o for o in ctx.observers if o != self.drafter.observe]
        logits = r.forward(seqs, [[s.output_ids[-1]] for s in seqs], ctx=ctx)  # [B, V]
        for s in seqs:
            r.commit(s, 1)
        t1 = now(dev)
        toks = sample(logits, [s.params for s in seqs], [s.generator for s in seqs],
                      [len(s.output_ids) for s in seqs])
        dt = now(dev) - t0
        self.breakdown.target(t1 - t0, r.expert_s - e0, r.provider.fetch_wait_s - w0)
        self.breakdown.accept(t0 + dt - t1)
        self.ar_steps += 1
        self.ar_time += dt
        self.plain_run += 1
        if self.plain_run >= self.DORMANT_AFTER and self.drafter.ready and not self.dormant:
            self._unpin()
        return {s.seq_id: [t] for s, t in zip(seqs, toks)}

    @torch.inference_mode()
    def _spec_step(self, seqs: list[Sequence], gammas: list[int], plan=None) -> dict[int, list[int]]:
        dev = self.runner.device
        self.plain_run = 0
        self.last_setup = not self.drafter.ready or self.dormant
        ts = now(dev)
        if not self.drafter.ready:
            self.drafter.setup()
            self.breakdown.setup(now(dev) - ts)
        elif self.dormant:
            self._repin()
        gammas = list(gammas)
        hook, conf = self.ctl.stopper(plan, seqs, gammas) if plan is not None else (None, None)
        t0 = now(dev)
        r = self.runner
        e0, f0 = r.expert_s, self.drafter.refresh_s
        b0, p0 = self._bytes(), self.drafter.prefetch_bytes
        noise = step_noise(seqs, gammas, self.runner.model.cfg.vocab_size, dev)
        drafts, q = draft(self.runner, self.drafter, seqs, gammas, noise, on_logits=hook)
        G = max(gammas, default=0)  # rows may have stopped early (the controller's stopping rule)
        drafts = drafts[:, :G]
        q = q[:, :G] if q is not None else None
        # bytes the draft itself fetched (always 0: it computes from its pinned slots in place); draft-guided
        # prefetch loads in the background for the verification and is counted apart
        self.draft_phase_bytes += self._bytes() - b0 - (self.drafter.prefetch_bytes - p0)
        picks = ({layer: (set(w), set(self.drafter.ids[layer])) for layer, w in self.drafter.prefetch_want.items()}
                 if self.drafter.prefetch else None)
        t1 = now(dev)
        e1, w1 = r.expert_s, r.provider.fetch_wait_s
        self.last_counts = {}
        logits = verify(self.runner, self.drafter, seqs, drafts, gammas)  # [B, T, V]
        t2 = now(dev)
        out = accept(seqs, drafts, q, logits, gammas, noise)
        for s, toks in zip(seqs, out):
            self.runner.commit(s, len(toks))  # K/V of the pending token + the accepted drafts
        t3 = now(dev)
        self.last_parts = (t1 - ts, t3 - t1)  # (draft phase with any setup, verification + acceptance)
        self.breakdown.draft(t1 - t0, e1 - e0)
        self.breakdown.target(t2 - t1, r.expert_s - e1, r.provider.fetch_wait_s - w1, self.drafter.refresh_s - f0)
        self.breakdown.accept(t3 - t2)
        self.tally.record(out, gammas, t1 - t0, t2 - t1, t3 - t2)
        if picks is not None:
            self._score_prefetch(picks)
        if self.ctl is not None:
            self.ctl.acc.record([s.seq_id for s in seqs], gammas, [len(t) - 1 for t in out], conf)
        return {s.seq_id: toks for s, toks in zip(seqs, out)}

    def _score_prefetch(self, picks: dict) -> None:
        """Draft-guided prefetch's prediction (the target routers' picks on drafted tokens, outside the draft
        set) against what verification needed outside the draft set, per layer."""
        for layer, counts in self.last_counts.items():
            want, dset = picks.get(layer, (set(), set(self.drafter.ids.get(layer, ()))))
            need = {e for e, c in enumerate(counts) if c} - dset
            self.pf["tp"] += len(want & need)
            self.pf["fp"] += len(want - need)
            self.pf["fn"] += len(need - want)

    def stats(self) -> dict:
        st = {"decoding": self.name, "drafter": "self", **self.tally.stats(), "ar_steps": self.ar_steps,
              "num_draft_tokens": self.gamma, "draft_experts": self.drafter.n,
              "substitution": self.drafter.substitution, "draft_policy": self.drafter.policy,
              "ar_time_s": self.ar_time, "draft_phase_bytes": self.draft_phase_bytes,
              "step_breakdown": dict(self.breakdown.s)}
        st.update(self.drafter.stats())
        if self.drafter.prefetch:
            tp, fp, fn = self.pf["tp"], self.pf["fp"], self.pf["fn"]
            st["draft_prefetch_precision"] = tp / (tp + fp) if tp + fp else None
            st["draft_prefetch_recall"] = tp / (tp + fn) if tp + fn else None
        if self.ctl is not None:
            st.update(self.ctl.stats())
            st.update(controller_s=self.controller_s, draft_set_unpins=self.unpins,
                      step_predictions=[list(p) for p in self.predictions])
            st["fallback_choice"] = "specmoe" if self.tally.steps and not self.ar_steps else (
                "ar" if self.ar_steps and not self.tally.steps else "mixed")
        else:
            st["fallback_choice"] = "specmoe"
        return st
