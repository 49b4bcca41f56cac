"""One speculative step for every drafter (`decoding="specmoe"` and `decoding="auto"`).

A step over the active sequences reads as five calls:

    plan     per sequence: which drafter and how many tokens it may draft (none: a plain row); `auto`'s
             controller chooses (`controller.py`), a fixed configuration drafts its γ with its drafter
    propose  each drafter proposes the trees of its rows (`Drafter.propose_tree`; a chain is a tree of width 1)
    select   the cost-aware selector may keep an ancestor-closed subtree of each (`treeselect.TreeSelector`)
    verify   ONE target forward over every row's pending token + its nodes (tree mask where a row branches);
             each MoE layer fetches the union of its experts once for the whole batch
    accept   `tree.accept`: greedy / seeded (Gumbel, exact match) / multi-draft rejection sampling
    commit   the accepted path's K/V compacted onto consecutive positions, lengths advanced

A step where no sequence drafts is a plain step: the same forward as `AutoregressiveDecoder`, without any
drafter's observers, so it costs what an AR step costs. Timing and counters wrap the phases from outside
(`PhaseClock`); the algorithm does not read clocks.
"""
from __future__ import annotations


import torch

from specmoe.decoding.control.plan import StepPlan
from specmoe.decoding.control.view import StepView
from specmoe.decoding.runtime.breakdown import SpecTally, StepBreakdown, now
from specmoe.decoding.strategies.autoregressive import plain_tokens
from specmoe.decoding.strategies.budget import ExpertBudget
from specmoe.decoding.strategies.clock import PhaseClock
from specmoe.decoding.strategies.protocol import StepInput, StepOutput, StrategyStats
from specmoe.decoding.drafters.base import Drafter
from specmoe.decoding.runtime.runner import ModelRunner
from specmoe.decoding.runtime.sampling import coupled_noise
from specmoe.decoding.runtime.sequence import Sequence
from specmoe.decoding.control.learning import Acceptance
from specmoe.decoding.trees.tree import DraftTree, accept, compaction, pack

# B=sequences, T=verified rows per sequence (pending token + nodes, padded), V=vocab


def step_noise(seqs: list[Sequence], gammas: list[int], vocab: int, device) -> dict[int, torch.Tensor]:
    """Gumbel noise [γ_b+1, V] of the output positions a step may emit, for each seeded sampled row b."""
    return {b: coupled_noise(s.params.seed, len(s.output_ids), g + 1, vocab, device)
            for b, (s, g) in enumerate(zip(seqs, gammas)) if not s.params.greedy and s.params.seed is not None}


class DrafterTally:
    """Per drafter: rows it drafted, tokens they emitted and accepted, and a row-share of each step's bytes."""

    def __init__(self):
        self.rows = self.emitted = self.accepted = self.drafted = 0
        self.bytes = 0.0
        self.draft_s = 0.0

    def to_dict(self) -> dict:
        return {"rows": self.rows, "drafted_tokens": self.drafted, "accepted_tokens": self.accepted,
                "tokens_per_step": self.emitted / self.rows if self.rows else 0.0,
                "expert_bytes_per_token": self.bytes / self.emitted if self.emitted else 0.0,
                "draft_time_s": self.draft_s}


class SpeculativeDecoder:
    """`drafters`: name -> Drafter, the first the default of a fixed configuration; `controller`: `auto`'s
    (per step and per sequence: plain, or a drafter with a draft budget); `width` > 1 proposes trees;
    `selector` keeps a cost-aware subtree; `budget`: MoE-Spec's lossy verification expert budget."""

    def __init__(self, runner: ModelRunner, drafters: dict[str, Drafter], *, num_draft_tokens: int,
                 max_model_len: int, width: int = 1, selector=None, budget: ExpertBudget | None = None,
                 controller=None):
        self.runner, self.drafters = runner, drafters
        self.gamma, self.max_model_len, self.width = num_draft_tokens, max_model_len, width
        self.selector, self.budget, self.ctl = selector, budget, controller
        self.name = "auto" if controller is not None else "specmoe"
        self.default = next(iter(drafters))
        if controller is not None:  # it plans over these drafters and learns the target's routing
            controller.use(list(drafters), width)
            if controller.observer not in runner.observers:
                runner.observers.append(controller.observer)
            # a draft set pinned by an earlier run stays pinned in the cache; auto's plain steps need the slots
            for layer in controller.layers:
                runner.provider.pin(layer, [])
        # each drafter's acceptance: ONE estimate (`learning.Acceptance`), recorded here once per step, that the
        # controller's plans and the tree selection both price with (auto's controller keeps it across engines)
        self.accs = controller.acceptance() if controller is not None else {
            n: Acceptance.of(n, num_draft_tokens) for n in drafters}
        if selector is not None:
            # routing frequency, resident experts (the expert term); under auto, the controller's cost model
            selector.attach(runner, self.accs, controller.cost_model() if controller is not None else None)
            for d in drafters.values():
                d.record_picks = selector.experts and d.name == "self"
        self.tally = SpecTally(num_draft_tokens)
        self.per_drafter = {name: DrafterTally() for name in drafters}
        self.breakdown = StepBreakdown()
        self.plain_steps, self.plain_s = 0, 0.0
        self.step_bytes = self.draft_phase_bytes = 0
        self.nodes = self.proposed_nodes = self.branched = self.moved = 0
        self.refresh0 = {n: d.refresh_s for n, d in drafters.items()}
        self._last: tuple[float, float, int] | None = None  # the last step's (start, priced seconds, batch)

    # ------------------------------------------------------------ the step
    def limit(self, s: Sequence) -> int:
        """Never draft past what the sequence may still emit (max_tokens, context length)."""
        left = min(s.params.max_tokens - len(s.output_ids), self.max_model_len - s.num_tokens)
        return max(0, min(self.gamma, left - 1))

    def plan(self, seqs: list[Sequence]) -> StepPlan:
        limits = [self.limit(s) for s in seqs]
        if self.ctl is not None:
            return self.ctl.plan_step(self.view(seqs, limits))
        return StepPlan([self.default] * len(seqs), limits)

    def view(self, seqs: list[Sequence], limits: list[int]) -> StepView:
        """What the controller reads of this step: the drafters' proposal lengths and catch-ups, the store's
        resident experts, the drafters' draft sets."""
        ds = self.drafters
        return StepView(seqs, limits, tuple(ds), lambda n: ds[n].available(seqs, limits),
                        lambda n: ds[n].catchup(seqs), self.runner.provider.resident,
                        lambda: {n: x for n, d in ds.items() if (x := d.draft_set()) is not None})

    def step(self, inp: StepInput) -> StepOutput:
        seqs, t0 = inp.seqs, now(self.runner.device)
        if self.ctl is not None and self._last is not None and not inp.new:
            # the last step's whole cycle (its start to this one's) less what it priced: the plan, the controller's
            # learning, the engine's loop between steps; not across a request's admission (its prefill)
            start, priced, B = self._last
            self.ctl.note_outside(B, t0 - start - priced)
        live = {s.seq_id for s in seqs}
        for d in self.drafters.values():
            d.retire(live)
        clock = PhaseClock(self.runner)
        if inp.new and self.ctl is not None:  # whatever this step does: not charged to its plan
            with clock.phase("admit"):
                self.ctl.admit(inp.new)
        with clock.phase("plan"):
            plan = self.plan(seqs)
        b0 = self.runner.provider.bytes_moved
        trees = paths = depths = None
        if plan.plain:
            out = self.plain_step(seqs, clock)
        else:
            out, trees, paths = self.speculate(seqs, plan, clock)
            depths = [t.depth() for t in trees]
        if self.ctl is not None:
            self.ctl.learn(plan, seqs, depths, out, clock, self.runner.provider.bytes_moved - b0)
        if trees is not None:  # after the controller's learning, which compares with the estimates before the step
            self.record_acceptance(plan, seqs, trees, paths, out)
        self._last = (t0, clock.priced_s(), len(seqs))
        return StepOutput({s.seq_id: toks for s, toks in zip(seqs, out)})

    @torch.inference_mode()
    def plain_step(self, seqs: list[Sequence], clock: PhaseClock) -> list[list[int]]:
        """The AR step (`autoregressive.plain_tokens`), no drafter observing its forward."""
        toks = plain_tokens(self.runner, seqs, clock, ctx=self._context([]))
        for d in self.drafters.values():
            d.idle()
        self.plain_steps += 1
        self.plain_s += clock.wall("verify") + clock.wall("accept")
        self._account(clock)
        return [[t] for t in toks]

    @torch.inference_mode()
    def speculate(self, seqs: list[Sequence], plan: StepPlan, clock: PhaseClock
                  ) -> tuple[list[list[int]], list[DraftTree], list[list[int]]]:
        """The draft phase, selection, one verification, acceptance and commit → (tokens per row, the trees
        verified, the accepted forward rows of each)."""
        r = self.runner
        gammas = [g if d else 0 for d, g in zip(plan.drafter_of, plan.gammas)]
        groups: dict[str, list[int]] = {}
        for b, (d, g) in enumerate(zip(plan.drafter_of, gammas)):
            if g:
                groups.setdefault(d, []).append(b)
        used = [self.drafters[name] for name in groups]
        with clock.phase("setup"):
            for d in used:
                d.prepare()
        with clock.phase("catchup"):  # apart from the draft phase (`Drafter.sync`), timed with each drafter's draft
            for name, rows in groups.items():
                with clock.phase(f"draft:{name}"):
                    self.drafters[name].sync([seqs[b] for b in rows])
        for name, d in self.drafters.items():
            if name not in groups:
                d.idle()
        noise = step_noise(seqs, gammas, r.model.cfg.vocab_size, r.device)
        b0, p0 = r.provider.bytes_moved, sum(d.prefetch_bytes for d in used)
        with clock.phase("draft"):
            trees = self.propose(seqs, groups, gammas, noise, plan, clock)
        # what the draft phase itself fetched (0: drafters compute from resident weights); draft-guided
        # prefetch loads in the background for the verification and is counted apart
        self.draft_phase_bytes += r.provider.bytes_moved - b0 - (sum(d.prefetch_bytes for d in used) - p0)
        self.proposed_nodes += sum(len(t) for t in trees)
        with clock.phase("select"):
            if self.selector is not None:
                trees = self.selector.choose_trees(trees, plan.drafter_of)
        lengths = [r.cache.lengths[s.slot] for s in seqs]
        with clock.phase("verify"):
            logits, depths, lens, tokens = self.verify(seqs, trees, used)
        with clock.phase("accept"):
            paths, out = accept(seqs, trees, logits, depths, noise, tokens)
        with clock.phase("commit"):
            self.commit(seqs, paths, out, logits, lengths)
        if self.selector is not None:
            wall, _, wait = clock.spans["verify"]
            self.selector.record_trees(trees, len(lens) * max(lens), wall, wait)
        self._record(plan, trees, out, clock, r.provider.bytes_moved - b0)
        return out, trees, paths

    def record_acceptance(self, plan: StepPlan, seqs: list[Sequence], trees: list[DraftTree],
                          paths: list[list[int]], out: list[list[int]]) -> None:
        """Fold the step's verified trees into each drafter's acceptance estimate (with the drafts' confidences
        where the controller's draft hook read them)."""
        rows: dict[str, list[int]] = {}
        for b, d in enumerate(plan.drafter_of):
            if d:
                rows.setdefault(d, []).append(b)
        for d, rs in rows.items():
            conf = self.ctl.confidences(rs) if self.ctl is not None else [[] for _ in rs]
            self.accs[d].record([seqs[b].seq_id for b in rs], [trees[b].depth() for b in rs],
                                [len(out[b]) - 1 for b in rs], conf, [trees[b] for b in rs], [paths[b] for b in rs])

    def propose(self, seqs, groups: dict[str, list[int]], gammas: list[int], noise, plan: StepPlan,
                clock: PhaseClock) -> list[DraftTree]:
        """Each drafter proposes the trees of its rows; rows that draft nothing get an empty tree."""
        trees = [DraftTree([], []) for _ in seqs]
        for name, rows in groups.items():
            sub = [seqs[b] for b in rows]
            g = [gammas[b] for b in rows]
            nz = {i: noise[b] for i, b in enumerate(rows) if b in noise}
            hook = self.ctl.stopper(plan, name, rows, sub, g) if self.ctl is not None else None
            with clock.phase(f"draft:{name}"):
                width = plan.width if plan.width is not None else self.width
                for b, t in zip(rows, self.drafters[name].propose_tree(sub, g, width, nz, hook)):
                    trees[b] = t
        return trees

    def verify(self, seqs: list[Sequence], trees: list[DraftTree], used: list[Drafter]):
        """One target forward over the pending tokens + every row's nodes → (logits [B, T, V], depths, lens,
        the input tokens [B, T])."""
        r, dev = self.runner, self.runner.device
        tokens, lens, depths, mask = pack(seqs, trees, dev)
        if self.budget is not None:  # padding rows do not vote
            self.budget.real = (torch.arange(tokens.shape[1], device=dev)[None, :]
                                < torch.tensor(lens, device=dev)[:, None]).reshape(-1)
        bv = r.tree_view(seqs, lens, depths, mask) if mask is not None else None
        for d in used:
            d.begin_verify()
        try:
            logits = r.forward_padded(seqs, tokens, lens, ctx=self._context(used), all_logits=True, view=bv)
        finally:
            for d in used:
                d.end_verify()
        return logits, depths, lens, tokens

    def commit(self, seqs, paths: list[list[int]], out: list[list[int]], logits: torch.Tensor,
               lengths: list[int]) -> None:
        r = self.runner
        src, dst = compaction(seqs, paths, lengths, r.cache.max_seq)
        if src:
            r.cache.move(torch.tensor(src, device=r.device), torch.tensor(dst, device=r.device))
            for d in self.drafters.values():
                d.compacted(seqs, paths, lengths)
        r.rerecord(seqs, paths, logits)
        for s, toks in zip(seqs, out):
            r.commit(s, len(toks))  # K/V of the pending token + the accepted path, now consecutive
        self.moved += len(src)

    def _context(self, used: list[Drafter]):
        """The verification's ForwardContext: without the observers of drafters not in `used`."""
        # by equality: a bound method (drafter.observe) is a new object at every attribute read, so ids never match
        skip = [o for d in self.drafters.values() if d not in used for o in d.target_observers()]
        ctx = self.runner.context(routing_hook=self.budget if used else None)
        ctx.observers = [o for o in ctx.observers if o not in skip]
        return ctx

    # ------------------------------------------------------------ accounting (outside the algorithm)
    def _account(self, clock: PhaseClock, refresh_s: float = 0.0) -> None:
        bd = self.breakdown
        sp = clock.spans
        if "setup" in sp or "admit" in sp:  # the breakdown's setup: admitting new sequences and drafters' prepare
            bd.setup(sp.get("setup", (0.0,))[0] + sp.get("admit", (0.0,))[0])
        if "draft" in sp:
            bd.draft(sp["draft"][0] + sp.get("select", (0.0,))[0] + sp.get("catchup", (0.0,))[0],
                     sp["draft"][1] + sp.get("catchup", (0.0, 0.0))[1])
        w, e, f = sp["verify"]
        bd.target(w, e, f, refresh_s)
        bd.accept(sp["accept"][0] + sp.get("commit", (0.0,))[0] + sp["plan"][0])

    def _record(self, plan: StepPlan, trees: list[DraftTree], out: list[list[int]], clock: PhaseClock,
                step_bytes: int) -> None:
        used = {d for d, t in zip(plan.drafter_of, trees) if d and len(t)}
        refresh = sum(self.drafters[n].refresh_s - self.refresh0[n] for n in used)
        self.refresh0 = {n: d.refresh_s for n, d in self.drafters.items()}
        self._account(clock, refresh)
        depth = [t.depth() for t in trees]
        self.tally.record(out, depth, clock.wall("draft"), clock.wall("verify"),
                          clock.wall("accept") + clock.wall("commit"))
        self.tally.verified += sum(len(t) - d for t, d in zip(trees, depth))  # the nodes off the deepest path
        self.nodes += sum(len(t) for t in trees)
        self.branched += sum(1 for t in trees if not t.is_chain)
        self.step_bytes += step_bytes
        for n in used:
            self.per_drafter[n].draft_s += clock.wall(f"draft:{n}")
        share = step_bytes / len(out)  # a row's share of the step's expert bytes
        for d, t, toks in zip(plan.drafter_of, trees, out):
            if d and len(t):
                pt = self.per_drafter[d]
                pt.rows += 1
                pt.emitted += len(toks)
                pt.accepted += len(toks) - 1
                pt.drafted += len(t)
                pt.bytes += share

    def stats(self) -> StrategyStats:
        emitted = self.tally.emitted
        st = {**self.tally.stats(), "ar_steps": self.plain_steps, "ar_time_s": self.plain_s,
              "plain_step_share": self.plain_steps / max(1, self.plain_steps + self.tally.steps),
              "num_draft_tokens": self.gamma, "draft_phase_bytes": self.draft_phase_bytes,
              "expert_bytes_per_token": self.step_bytes / emitted if emitted else 0.0,
              "drafters": {name: t.to_dict() for name, t in self.per_drafter.items()}}
        for d in self.drafters.values():
            st.update(d.stats())
        st["drafter"] = self.default if self.ctl is None else "+".join(self.drafters)
        if self.budget is not None:
            st.update(self.budget.stats())
        st.update(self.selector.stats() if self.selector is not None else {"draft_selection": "all"})
        if self.width > 1:
            n = self.tally.seq_steps
            acc = self.tally.stats()["accepted_tokens"]
            st.update({"draft_tree": True, "draft_tree_width": self.width, "tree_nodes_verified": self.nodes,
                       "tree_nodes_proposed": self.proposed_nodes,
                       "tree_nodes_per_step": self.nodes / n if n else 0.0,
                       "tree_nodes_rejected": self.nodes - acc,
                       "accepted_path_length": acc / n if n else 0.0,
                       "tree_branched_rows": self.branched, "tree_kv_rows_moved": self.moved})
        if self.ctl is not None:
            st.update(self.ctl.stats())
        st["fallback_choice"] = ("specmoe" if self.tally.steps and not self.plain_steps else
                                 "ar" if self.plain_steps and not self.tally.steps else
                                 "mixed" if self.plain_steps else "specmoe")
        return StrategyStats(self.name, dict(self.breakdown.s), st)
