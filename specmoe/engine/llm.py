"""The user-facing `LLM`: a thin front over the engine.

It loads a checkpoint (model, expert store, tokenizer), sizes the KV cache for what it is asked, and
hands an `EngineCore` (engine/core.py) the parts it runs on; the core schedules the requests, applies the
stop rules and builds each request's text. `generate` drives a core to completion, `logits` scores
prompts, `stats` joins the counters (engine/stats.py) with the strategy's and the expert store's.
"""
from __future__ import annotations

import contextlib
import threading
from pathlib import Path
from typing import Iterator

import torch
from tqdm import tqdm

from specmoe import kernels as native
from specmoe.bundled import demo_model_dir
from specmoe.decoding.strategies.factory import lookahead, make_strategy
from specmoe.decoding.runtime.runner import ModelRunner
from specmoe.decoding.runtime.sampling import SamplingParams, check_finite, finite_rows
from specmoe.decoding.runtime.sequence import Sequence
from specmoe.engine.auto import controller_of
from specmoe.engine.core import EngineCore, Request, wired_runner
from specmoe.engine.outputs import RequestOutput
from specmoe.engine.prompts import normalize_params, normalize_prompts
from specmoe.engine.stats import EngineStats, MemoryStats
from specmoe.experts.factory import build_store, plan_store
from specmoe.memory import check_fits, device_memory
from specmoe.engine.translation import check_translation_args, translation_requests
from specmoe.errors import InputError, UnsupportedModelError
from specmoe.models.kv_cache import KVCache, make_cache, model_cache_bytes, round_positions
from specmoe.models.linear_state import for_lookahead
from specmoe.models.loader import load_model
from specmoe.options import check_llm_args, resolve_device, split_options
from specmoe.tokenizer import Tokenizer
from specmoe.weights.checkpoint import Checkpoint, resolve_dtype

# the installed copy (wheel) if there is one, else the repository's: see specmoe/bundled.py
DEMO_MODEL = demo_model_dir(check=False)
SERVE_INITIAL_SLOTS = 8  # KV slots a serving engine starts with (it grows by doubling up to its cap)


def default_model_path() -> Path:
    return demo_model_dir()


class LLM:
    """`LLM(model=None|path, dtype="auto", device="cpu")`; `generate`, `logits`, `stats`."""

    def __init__(self, model: str | Path | None = None, *, dtype: str | torch.dtype = "auto",
                 device: str = "cpu", max_batch: int = 256, max_model_len: int | None = None,
                 progress: bool = False, threads: int | None = None, **options):
        """`options` are the fields of OffloadConfig (offload=, cache_experts=, ...) and SpecConfig
        (decoding=, draft_experts=, ...)."""
        self.offload_cfg, self.spec_cfg = split_options(dict(options))
        check_llm_args(model=model, max_batch=max_batch, max_model_len=max_model_len, progress=progress,
                       threads=threads)
        self.device = resolve_device(device)
        if threads is not None:  # like llama.cpp's -t: process-wide intra-op threads
            torch.set_num_threads(threads)
        self.path = Path(model) if model is not None else default_model_path()
        self._lock = threading.Lock()  # one generate/logits at a time: they share the KV cache and stats
        self.ckpt = Checkpoint(self.path)
        self.config = self.ckpt.config
        if self.config.seq2seq is not None and (self.spec_cfg.decoding == "auto" or self.spec_cfg.drafter == "eagle"):
            raise UnsupportedModelError(f"{self.path} is an encoder–decoder model ({self.config.model_type}): "
                                        "decoding='auto' and the eagle drafter are not supported for it; use "
                                        "decoding='specmoe' with drafter 'self' or 'ngram'")
        self.dtype = resolve_dtype(dtype, default=self.config.dtype, device=self.device)
        draft_experts = self.spec_cfg.draft_experts if self.spec_cfg.decoding != "ar" else 0
        # the expert memory and the memory limit are checked before any weight is loaded
        store_plan = plan_store(self.ckpt, self.offload_cfg, dtype=self.dtype, device=self.device,
                                draft_experts=draft_experts)
        self.model = load_model(self.ckpt, dtype=self.dtype, device=self.device, progress=progress)
        self.model.set_deterministic(self.spec_cfg.deterministic)
        self.store, self.expert_memory = build_store(self.ckpt, self.offload_cfg, dtype=self.dtype,
                                                     device=self.device, draft_experts=draft_experts,
                                                     progress=progress, model=self.model, plan=store_plan)
        self.tokenizer = Tokenizer.load(self.path)
        self.max_model_len = min(max_model_len or self.config.max_position_embeddings,
                                 self.config.max_position_embeddings)
        self.max_batch = max_batch
        eos = set(self.config.eos_token_ids)
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = eos
        self._cache: KVCache | None = None
        self._stats = EngineStats()
        self._next_id = 0
        self._live: EngineCore | None = None  # the engine core running now (see engine())
        self.draft_memo: dict = {}  # SpecMoE parts that outlive a generate call (see decoding.factory)

    # ---------------------------------------------------------------- helpers
    def _cache_for(self, slots: int, positions: int, cap: int, look: int = 1) -> KVCache:
        """A KV cache of at least `slots` slots × `positions` positions (rounded up to a block, at most `cap`,
        the most positions the run can write), with linear-attention states for steps writing up to `look`
        positions past the committed length. The previous cache is reused only if it covers that and is at
        most twice its size, so KV memory follows the admitted requests, not max_batch × the context."""
        want, ring = round_positions(positions, cap), for_lookahead(look)
        c = self._cache
        if (c is None or c.max_batch < slots or c.max_seq < want or c.nbytes > 2 * c.bytes_for(slots, want)
                or (c.states is not None and c.states.ring < ring)):
            self._cache = None  # free the old one first
            self._cache = make_cache(self.config, max_batch=slots, max_seq=want, dtype=self.dtype,
                                     device=self.device, ring=ring)
        self._cache.lengths = [0] * self._cache.max_batch
        return self._cache

    def _kv_slots(self, longest: int, requests: int, look: int, what: str) -> int:
        """Slots for the requests that can be active at once: min(max_batch, requests, how many sequences of
        the `longest` length (prompt + max_tokens) the device's free memory holds), so the cache never outgrows
        memory mid-run (requests beyond it wait). A request that cannot fit even alone (`what` names it) is
        refused before any work."""
        cfg = self.config
        n = min(self.max_model_len, longest) + look
        one = model_cache_bytes(cfg, self.dtype, 1, n, for_lookahead(look))
        check_fits(f"the KV cache of {what} + {look} lookahead = {n} positions × {cfg.num_layers} layers)", one,
                   self.device)
        room = device_memory(self.device)[1] + (self._cache.nbytes if self._cache is not None else 0)
        return max(1, min(self.max_batch, requests, room // one))

    def runner(self, slots: int, positions: int) -> ModelRunner:
        """A ModelRunner over an empty KV cache of at least `slots` × `positions`, its forwards observed by the
        expert store: for forwards of one's own (scoring, research scripts). Not for use while `generate` runs
        in another thread (they share the KV cache)."""
        return wired_runner(self.model, self.store, self._cache_for(slots, positions, positions), self.device)

    def _tokenize(self, prompts, scoring: bool = False) -> tuple[list[str | None], list[list[int]]]:
        return normalize_prompts(prompts, tokenizer=self.tokenizer, vocab_size=self.config.vocab_size,
                                 max_model_len=self.max_model_len, model_path=self.path, scoring=scoring)

    def decode(self, ids: list[int]) -> str:
        """The text of token ids, special tokens skipped ("" without a tokenizer)."""
        return self.tokenizer.decode(ids) if self.tokenizer is not None else ""

    # ---------------------------------------------------------------- API
    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None, *,
                 use_tqdm: bool = False, target_lang: str | int | list | None = None,
                 source_lang: str | int | list | None = None) -> list[RequestOutput]:
        """Complete `prompts`. An encoder–decoder (translation) model translates them instead: `target_lang` (a
        language code such as "fra_Latn", or a token id; one for all prompts or one per prompt) is required,
        `source_lang` defaults to eng_Latn (see engine/translation.py)."""
        check_translation_args(self.config, target_lang, source_lang, self.path)
        if self.config.seq2seq is not None:
            reqs = translation_requests(prompts, target_lang, source_lang, tokenizer=self.tokenizer, cfg=self.config,
                                        max_model_len=self.max_model_len, model_path=self.path)
            plist = normalize_params(params, len(reqs))
            return self._run([r.text for r in reqs], [r.prompt_ids for r in reqs], plist, use_tqdm=use_tqdm,
                             sources=[r.source_ids for r in reqs])
        texts, prompt_ids = self._tokenize(prompts)
        plist = normalize_params(params, len(prompt_ids))
        return self._run(texts, prompt_ids, plist, use_tqdm=use_tqdm)

    @contextlib.contextmanager
    def engine(self, plan: list[tuple[list[int], SamplingParams]] | None = None) -> Iterator[EngineCore]:
        """Hold the engine (its lock) and yield a step-level `EngineCore` over this LLM's model, experts and KV
        cache; its strategy's counters join `stats` when it closes. `plan` (prompt ids, params) per request
        sizes the KV cache for exactly those requests (`generate`); None sizes it for serving: slots grow on
        demand up to max_batch (or what memory holds at the full context), positions up to the context."""
        with self._lock:
            look = lookahead(self.spec_cfg, self.config)  # KV positions a step writes past the committed length
            if plan is not None:
                lengths = [len(p) + sp.max_tokens for p, sp in plan]
                i = max(range(len(plan)), key=lambda i: lengths[i])
                cap = min(self.max_model_len, lengths[i]) + look
                what = f"request {i} ({len(plan[i][0])} prompt + {plan[i][1].max_tokens} max_tokens"
                slots = self._kv_slots(lengths[i], len(plan), look, what)  # requests that can be active at once
                cache = self._cache_for(slots, max(len(p) for p, _ in plan[:slots]) + look, cap, look)
            else:
                cap = self.max_model_len + look
                what = f"one sequence at the full context ({self.max_model_len} positions"
                slots = self._kv_slots(self.max_model_len, self.max_batch, look, what)
                cache = self._cache_for(min(slots, SERVE_INITIAL_SLOTS), look + 1, cap, look)
            runner = wired_runner(self.model, self.store, cache, self.device)
            controller = controller_of(self) if self.spec_cfg.decoding == "auto" else None
            strategy = make_strategy(runner, self.spec_cfg, ckpt=self.ckpt, max_model_len=self.max_model_len,
                                     memo=self.draft_memo, controller=controller)
            core = EngineCore(runner, strategy, cache, stats=self._stats, tokenizer=self.tokenizer,
                              eos_token_ids=self.eos_token_ids, max_model_len=self.max_model_len, slot_cap=slots,
                              cap=cap, look=look)
            self._live = core
            try:
                yield core
            finally:
                self._live = None
                core.close()

    def _run(self, texts, prompt_ids, plist, *, use_tqdm: bool, sources=None) -> list[RequestOutput]:
        sources = sources or [None] * len(prompt_ids)
        with self.engine(list(zip(prompt_ids, plist))) as core:
            reqs = [core.add(Request(prompt_ids=p, params=sp, prompt=t, source_ids=src))
                    for p, t, sp, src in zip(prompt_ids, texts, plist, sources)]
            with tqdm(total=len(reqs), desc="requests", disable=not use_tqdm) as bar:
                while core.has_work:
                    bar.update(sum(u.finished for u in core.step()))
        outs = [RequestOutput(request_id=self._next_id + i, prompt=r.prompt, prompt_token_ids=r.prompt_ids,
                              text=r.text, token_ids=list(r.output_ids), finish_reason=r.finish_reason)
                for i, r in enumerate(reqs)]
        self._next_id += len(reqs)
        return outs

    @torch.inference_mode()
    def logits(self, token_id_lists: list[list[int]]) -> torch.Tensor:
        """Scoring: [B, T, V] fp32 logits for each position (right-padded with zeros); batches larger
        than max_batch run in chunks of max_batch. A prompt may fill the whole context (nothing is generated).
        Non-finite logits raise NonFiniteLogitsError."""
        if self.config.seq2seq is not None:
            raise InputError(f"logits (scoring) is for decoder-only models; {self.path} is an encoder–decoder "
                             f"({self.config.model_type}) model")
        _, ids = self._tokenize(token_id_lists, scoring=True)
        T = max(len(t) for t in ids)
        with self._lock:
            n = min(len(ids), self.max_batch)  # sequences per forward: the cache never exceeds max_batch slots
            runner = self.runner(n, T)
            cache = runner.cache
            out = torch.zeros(len(ids), T, self.config.vocab_size, device=self.device)
            for c in range(0, len(ids), n):
                chunk = ids[c:c + n]
                cache.lengths = [0] * cache.max_batch
                seqs = [Sequence(seq_id=i, prompt_ids=t, params=SamplingParams(), slot=i,
                                 generator=torch.Generator()) for i, t in enumerate(chunk)]
                got = runner.forward(seqs, chunk, all_logits=True)  # [b, T_chunk, V]
                for b, t in enumerate(chunk):
                    out[c + b, :len(t)] = got[b, :len(t)]
        check_finite(finite_rows(out).all(-1).tolist(), what="prompt")
        return out

    @property
    def stats(self) -> dict:
        """One flat dict: the engine's counters and rates, the decoding strategy's section (the running
        session's, else the last one's), the expert store's, bytes per token and the memory parts."""
        s = self._stats.to_dict(self._live.strategy_stats() if self._live is not None else None)
        s.update(self.store.stats())
        s["kernels"] = native.path() if self.device.type == "cpu" else "torch"  # which matmul path computes
        if s["generated_tokens"] and "bytes_moved" in s:
            s["bytes_per_token"] = s["bytes_moved"] / s["generated_tokens"]
        s["memory"] = MemoryStats.measure(self.model, self.expert_memory, self._cache).to_dict()
        return s

    def reset_stats(self) -> None:
        self._stats = EngineStats()
        self.store.reset_stats()

    def close(self) -> None:
        """Release the offloaded experts now: the disk tier's file, the I/O thread, the (pinned) host and
        staging buffers, and the KV cache. Idempotent; using the engine afterwards raises InputError. Waits
        for a generate/logits running in another thread (they hold the engine's lock)."""
        from specmoe.experts.store import ClosedStore
        store = self.__dict__.get("store")
        if store is None or isinstance(store, ClosedStore):
            return
        lock = self.__dict__.get("_lock")
        with lock if lock is not None else contextlib.nullcontext():
            store.close()
            self.store = ClosedStore(f"this LLM ({self.path})")
            self._cache = None

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
