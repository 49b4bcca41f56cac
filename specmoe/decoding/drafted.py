"""Speculative decoding with a pluggable `Drafter` at a fixed γ (`decoding="specmoe"`, `drafter` ≠ "self").

One step: the drafter proposes up to γ_b tokens per sequence (`Drafter.propose`), ONE target forward
verifies the pending token + the proposals of every sequence (`specmoe.verify`), and `specmoe.accept`
emits the accepted prefix + the correction/bonus token. Rows whose proposal is shorter than γ_b verify
fewer positions; an empty proposal makes that row a plain decoding step inside the same forward. With
`verify_expert_budget` the verification forward routes through `budget.ExpertBudget` (lossy).
"""
from __future__ import annotations

import torch

from specmoe.decoding.breakdown import SpecTally, StepBreakdown, now
from specmoe.decoding.budget import ExpertBudget
from specmoe.decoding.chainselect import ChainSelector
from specmoe.decoding.drafters import Drafter
from specmoe.decoding.runner import ModelRunner
from specmoe.decoding.sequence import Sequence
from specmoe.decoding.specmoe import accept, step_noise


class DraftedDecoder:
    name = "specmoe"

    def __init__(self, runner: ModelRunner, drafter: Drafter, *, num_draft_tokens: int, max_model_len: int,
                 budget: ExpertBudget | None = None, selector: ChainSelector | None = None):
        self.runner, self.drafter, self.budget, self.selector = runner, drafter, budget, selector
        self.gamma, self.max_model_len = num_draft_tokens, max_model_len
        self.tally = SpecTally(num_draft_tokens)
        self.draft_phase_bytes = self.step_bytes = 0
        self.breakdown = StepBreakdown()

    def _gamma_for(self, s: Sequence) -> int:
        """Never draft past what the sequence may still emit (max_tokens, context length)."""
        left = min(s.params.max_tokens - len(s.output_ids), self.max_model_len - s.num_tokens)
        return max(0, min(self.gamma, left - 1))

    def _begin(self, seqs: list[Sequence]):
        """Start of a step, shared with the tree decoder: draft lengths, the drafter's untimed setup, the step's
        noise (row j: output position j of the step) and the clocks and counters the draft phase starts from."""
        r, dev = self.runner, self.runner.device
        gammas = [self._gamma_for(s) for s in seqs]
        ts = now(dev)
        self.drafter.prepare()
        t0 = now(dev)
        self.breakdown.setup(t0 - ts)
        noise = step_noise(seqs, gammas, r.model.cfg.vocab_size, dev)
        return gammas, noise, t0, r.expert_s, r.provider.bytes_moved

    @torch.inference_mode()
    def step(self, seqs: list[Sequence]) -> dict[int, list[int]]:
        r, dev = self.runner, self.runner.device
        gammas, noise, t0, e0, b0 = self._begin(seqs)
        prop = self.drafter.propose(seqs, gammas, noise)
        gammas = prop.gammas if self.selector is None else self.selector.choose(prop.gammas)
        G = max(gammas, default=0)
        drafts, q = prop.drafts[:, :G], (prop.q[:, :G] if prop.q is not None else None)
        noise = {b: n[:gammas[b] + 1] for b, n in noise.items()}  # the positions this step verifies
        b1 = r.provider.bytes_moved
        self.draft_phase_bytes += b1 - b0
        t1 = now(dev)
        e1, w1 = r.expert_s, r.provider.fetch_wait_s
        d_list = drafts.tolist()
        ctx = r.context(routing_hook=self.budget)  # the MoE-Spec budget (lossy) when asked for, else exact
        if self.budget is not None:  # its tokens, flattened [B·T]: padding of shorter rows does not vote
            pos = torch.arange(G + 1, device=dev)[None, :]
            self.budget.real = (pos <= torch.tensor(gammas, device=dev)[:, None]).reshape(-1)
        self.drafter.begin_verify()
        try:
            logits = r.forward(seqs, [[s.output_ids[-1]] + d[:g] for s, d, g in zip(seqs, d_list, gammas)],
                               ctx=ctx, all_logits=True)  # [B, T, V]: the pending token + the proposals
        finally:
            self.drafter.end_verify()
        t2 = now(dev)
        out = accept(seqs, drafts, q, logits, gammas, noise)
        if self.selector is not None:
            self.selector.record(gammas, [len(t) - 1 for t in out], len(seqs) + sum(gammas), t2 - t1)
        for s, toks in zip(seqs, out):
            r.commit(s, len(toks))  # K/V of the pending token + the accepted drafts
        t3 = now(dev)
        self.step_bytes += r.provider.bytes_moved - b0
        self.breakdown.draft(t1 - t0, e1 - e0)
        self.breakdown.target(t2 - t1, r.expert_s - e1, r.provider.fetch_wait_s - w1)
        self.breakdown.accept(t3 - t2)
        self.tally.record(out, gammas, t1 - t0, t2 - t1, t3 - t2)
        return {s.seq_id: toks for s, toks in zip(seqs, out)}

    def stats(self) -> dict:
        emitted = self.tally.emitted
        st = {"decoding": self.name, **self.tally.stats(), "ar_steps": 0, "num_draft_tokens": self.gamma,
              "draft_phase_bytes": self.draft_phase_bytes,
              "expert_bytes_per_token": self.step_bytes / emitted if emitted else 0.0,
              "fallback_choice": "specmoe", "step_breakdown": dict(self.breakdown.s)}
        st.update(self.drafter.stats())
        if self.budget is not None:
            st.update(self.budget.stats())
        st.update(self.selector.stats() if self.selector is not None else {"draft_selection": "all"})
        return st
