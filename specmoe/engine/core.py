"""The step-level engine core: requests join and leave the running batch between decode steps.

`EngineCore` owns one engine session: the waiting queue, the active sequences with their KV-cache slots,
the decoding strategy, the stop rules and each request's text. `add` queues a request; `abort` ends one
(waiting or running) at the next step boundary, where its slot is freed; `step` runs one scheduler
iteration and returns an `Update` per request whose output changed: the tokens it added and the visible
text they added. One iteration is:

1. end the aborted requests (their slots become free);
2. if requests wait and a slot is free (or the cache may still grow by slots): admit as many as
   fit and prefill them together (their first token is sampled there);
3. otherwise one decoding-strategy step over every active sequence (one token each for AR,
   accepted drafts + 1 for SpecMoE);
4. append the tokens, stopping at EOS, a stop string, max_tokens or the context end; each request's
   `Detokenizer` turns its tokens into text as they arrive (engine/detokenizer.py: the stop-string and
   visible-text rules); finished sequences leave and free their slot.

The core knows nothing of `LLM`: `LLM.engine()` builds it from the runner, the strategy, the KV cache, the
counters to add to (`EngineStats`) and the tokenizer, and drives it until its requests are done
(`generate`); the server's loop (`specmoe.serve.engine`) drives one for its whole lifetime.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specmoe.decoding.runtime.prefill import prefill
from specmoe.decoding.strategies.protocol import StepInput
from specmoe.decoding.runtime.runner import ModelRunner
from specmoe.decoding.runtime.sampling import SamplingParams, make_generator
from specmoe.decoding.runtime.sequence import Sequence
from specmoe.engine.detokenizer import Detokenizer
from specmoe.engine.stats import EngineStats
from specmoe.errors import InputError
from specmoe.models.kv_cache import KVCache, round_positions
from specmoe.tokenizer import Tokenizer

ABORT = "abort"  # finish_reason of a request ended by `abort` (client gone, timeout, shutdown)


def wired_runner(model, store, cache: KVCache, device: torch.device) -> ModelRunner:
    """A ModelRunner whose forwards the expert store observes (routing telemetry) and hooks (prefetch)."""
    runner = ModelRunner(model, store, cache, device)
    runner.observers += store.forward_observers
    runner.layer_hooks += store.forward_layer_hooks
    return runner


@dataclass
class TokenLogprob:
    """A generated token's log-probability under the target model (raw logits, before temperature and
    top-k/top-p) and the `top` most likely tokens at that position as (token id, logprob)."""
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass
class Request:
    """One generation request as the core tracks it. `logprobs`: None for none, else how many top
    alternatives to report per generated token (0: only the chosen token's logprob)."""
    prompt_ids: list[int]
    params: SamplingParams
    prompt: str | None = None
    logprobs: int | None = None
    source_ids: list[int] | None = None  # encoder–decoder models: the encoder's input (prompt_ids: the decoder's)
    request_id: int = -1  # set by EngineCore.add
    seq: Sequence | None = None  # while running (and after)
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" (+ the abort's reason in abort_reason)
    abort_reason: str | None = None
    token_logprobs: list[TokenLogprob] = field(default_factory=list)
    detok: Detokenizer | None = None  # set by EngineCore.add

    @property
    def output_ids(self) -> list[int]:
        return self.seq.output_ids if self.seq is not None else []

    @property
    def text(self) -> str:
        """The text a caller has been given so far: the final text (cut before the first stop string) once
        the request finished."""
        return self.detok.text if self.detok is not None else ""


@dataclass
class Update:
    """What one step changed for one request: `new` tokens appended (their logprobs in
    request.token_logprobs[-new:] when asked), the visible `text` they added (the pieces of a request add
    up to its final text) and whether it finished."""
    request: Request
    new: int
    finished: bool
    text: str = ""


class EngineCore:
    """See the module docstring. `slot_cap`: most sequences active at once (the cache grows by slots up to
    it); `cap`: most KV positions a sequence may write (context + lookahead); `look`: positions a step writes
    past a sequence's committed length; `stats`: the counters this session adds to."""

    def __init__(self, runner: ModelRunner, strategy, cache: KVCache, *, stats: EngineStats,
                 tokenizer: Tokenizer | None, eos_token_ids: set[int], max_model_len: int, slot_cap: int, cap: int,
                 look: int):
        self.runner, self.strategy, self.cache, self.stats = runner, strategy, cache, stats
        self.tokenizer, self.eos_token_ids, self.max_model_len = tokenizer, frozenset(eos_token_ids), max_model_len
        self.cap, self.look, self.slot_cap = cap, look, slot_cap
        self.n_slots = min(cache.max_batch, slot_cap)
        self.waiting: list[Request] = []
        self.active: list[Request] = []
        self.free_slots = list(range(self.n_slots))
        self._aborts: dict[int, str] = {}
        self._ids = 0
        self._logits: dict[int, torch.Tensor] = {}
        # the step boundary (`StepInput`): sequences admitted and ids that left since the strategy's last step
        self._new: list[Sequence] = []
        self._left: list[int] = []
        self.aborted = 0  # requests ended by abort (counter)
        self.closed = False

    # ------------------------------------------------------------ queue
    def add(self, req: Request) -> Request:
        forced, vocab = req.params.forced_tokens, self.runner.model.cfg.vocab_size
        if forced is not None and any(t >= vocab for t in forced):
            raise InputError(f"forced_tokens hold ids outside the vocabulary [0, {vocab}): "
                             f"{[t for t in forced if t >= vocab][:5]}")
        req.request_id = self._ids
        req.detok = Detokenizer(self.tokenizer, req.params.stop)
        self._ids += 1
        self.waiting.append(req)
        self.stats.requests += 1
        return req

    def abort(self, request_id: int, reason: str = "aborted") -> None:
        """End a request at the next step boundary (a no-op for one already finished)."""
        self._aborts[request_id] = reason

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.active or self._aborts)

    @property
    def num_free_slots(self) -> int:
        """Slots free now plus those the cache may still grow by."""
        return len(self.free_slots) + self.slot_cap - self.n_slots

    # ------------------------------------------------------------ step
    def step(self) -> list[Update]:
        st = self.stats
        t0, timed0 = time.perf_counter(), st.timed_s
        updates = self._reap_aborts()
        if self.waiting and self.num_free_slots:
            updates += self._admit()
        elif self.active:
            updates += self._decode()
        for r in [r for r in self.active if r.finished]:
            self.active.remove(r)
            self._free(r.seq.slot)
            self._left.append(r.seq.seq_id)
        # scheduling: admission, KV growth, appending tokens and stop checks, slot release (not prefill or steps)
        st.scheduling_s += time.perf_counter() - t0 - (st.timed_s - timed0)
        return updates

    def _reap_aborts(self) -> list[Update]:
        out = []
        for rid, reason in self._aborts.items():
            for queue in (self.waiting, self.active):
                for r in queue:
                    if r.request_id == rid and not r.finished:
                        queue.remove(r)
                        if r.seq is not None:
                            self._free(r.seq.slot)
                            self._left.append(r.seq.seq_id)
                        r.finished, r.finish_reason, r.abort_reason = True, ABORT, reason
                        self.aborted += 1
                        out.append(Update(r, 0, True, r.detok.take(finished=True)))
                        break
        self._aborts.clear()
        return out

    def _free(self, slot: int) -> None:
        self.free_slots.append(slot)
        self.free_slots.sort()

    def _grow_slots(self, want: int) -> None:
        """Grow the cache to `want` slots (at most slot_cap), doubling, keeping every slot's contents."""
        n = min(self.slot_cap, max(want, 2 * self.n_slots))
        self.cache.reserve(n, self.cache.max_seq)
        self.free_slots += range(self.n_slots, n)
        self.n_slots = n

    def _admit(self) -> list[Update]:
        if len(self.free_slots) < len(self.waiting) and self.n_slots < self.slot_cap:
            self._grow_slots(len(self.active) + len(self.waiting))
        new = []
        while self.waiting and self.free_slots:
            r = self.waiting.pop(0)
            slot = self.free_slots.pop(0)
            self.cache.lengths[slot] = 0  # a freed slot's stale keys are masked until overwritten
            r.seq = Sequence(seq_id=r.request_id, prompt_ids=r.prompt_ids, params=r.params, slot=slot,
                             generator=make_generator(r.params.seed, self.runner.device), source_ids=r.source_ids)
            new.append(r)
        self.cache.reserve(self.n_slots, round_positions(max(len(r.prompt_ids) for r in new) + self.look, self.cap))
        seqs = sorted((r.seq for r in new), key=lambda s: s.slot)
        tally = {"prefill_time_s": 0.0, "prompt_tokens": 0}
        with self._recording(new):
            first = prefill(self.runner, seqs, tally)
        self.stats.prefill_time_s += tally["prefill_time_s"]
        self.stats.prompt_tokens += tally["prompt_tokens"]
        self.active += new
        self._new += [r.seq for r in new]
        return [self._append(r, first[r.request_id]) for r in new]

    def _decode(self) -> list[Update]:
        cache = self.cache
        cache.reserve(self.n_slots, round_positions(max(cache.lengths[r.seq.slot] for r in self.active) + self.look,
                                                    self.cap))
        with self._recording(self.active):
            live = {r.seq.seq_id for r in self.active}
            inp = StepInput([r.seq for r in self.active], [s for s in self._new if s.seq_id in live], self._left)
            self._new, self._left = [], []
            t0 = time.perf_counter()
            out = self.strategy.step(inp).tokens
            self.stats.decode_time_s += time.perf_counter() - t0
        self.stats.decode_steps += 1
        return [self._append(r, out[r.request_id]) for r in self.active]

    def _append(self, r: Request, tokens: list[int]) -> Update:
        """Append tokens one by one, stopping at EOS, a stop string, max_tokens or the context end. Tokens
        after the stop are dropped and their K/V positions rolled back, so the cache keeps the invariant
        of `Sequence` (a stop inside an accepted draft run truncates exactly there)."""
        s, p = r.seq, r.params
        new = 0
        for t in tokens:
            if s.finished:
                break
            s.output_ids.append(t)
            new += 1
            stopped = r.detok.push(t)
            if (t in self.eos_token_ids and not p.ignore_eos) or stopped:
                s.finished, s.finish_reason = True, "stop"
            elif len(s.output_ids) >= p.max_tokens or s.num_tokens >= self.max_model_len:
                s.finished, s.finish_reason = True, "length"
        self.cache.lengths[s.slot] -= len(tokens) - new
        self.stats.generated_tokens += new
        if r.logprobs is not None:
            r.token_logprobs += self._logprobs(r, tokens[:new])
        r.finished, r.finish_reason = s.finished, s.finish_reason
        return Update(r, new, r.finished, r.detok.take(r.finished))

    # ------------------------------------------------------------ logprobs
    def _recording(self, reqs: list[Request]):
        """While a step runs, keep the target forwards' logits if a request in it asks for logprobs."""
        self._logits = {}
        return self.runner.recording(any(r.logprobs is not None for r in reqs), self._logits)

    def _logprobs(self, r: Request, tokens: list[int]) -> list[TokenLogprob]:
        """The target's log-probabilities of the emitted tokens: emitted token j of a step is scored by the
        step's last target forward at the sequence's position j (prefill and AR: its one row)."""
        if not tokens:
            return []
        rows = self._logits[r.request_id]  # [T, V] or [V]
        rows = rows[: len(tokens)] if rows.dim() == 2 else rows[None]
        lp = torch.log_softmax(rows.float(), dim=-1)
        chosen = lp.gather(1, torch.tensor(tokens, device=lp.device)[:, None])[:, 0].tolist()
        k = min(r.logprobs, lp.shape[-1])
        top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
        return [TokenLogprob(t, c, list(zip(i, v))) for t, c, i, v in
                zip(tokens, chosen, top_i.tolist(), top_v.tolist())]

    # ------------------------------------------------------------ end
    def strategy_stats(self) -> dict:
        return self.strategy.stats().to_dict()

    def close(self) -> None:
        """Fold the strategy's counters into the stats (once)."""
        if self.closed:
            return
        self.closed = True
        self.stats.close_session(self.strategy.stats().to_dict())
