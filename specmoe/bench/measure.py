"""One measured `generate` call: wall time, engine stats, and an in-band time split of
expert fetch vs expert compute taken by wrapping the expert store.

The wrapper times the store's generator from outside: time spent inside `next()` is
the wait for an expert's bytes (a hit costs ~nothing, a miss the transfer not hidden by
prefetch); time between two `next()` calls is the consumer's expert FFN. Forwards are
counted so the prefill's share can be separated from decode.
"""
from __future__ import annotations

import gc
import time

from specmoe.decoding.runtime.prefill import MAX_PREFILL_TOKENS
from specmoe.decoding.runtime.sampling import SamplingParams
from specmoe.experts.store import DelegatingStore, ExpertStore


class TimedStore(DelegatingStore):
    """Forwards everything to the wrapped store; times `fetch` per call."""

    def __init__(self, inner: ExpertStore):
        super().__init__(inner)
        self.calls: list[tuple[float, float, int]] = []  # (fetch wait s, expert compute s, experts)
        self.used: dict[int, dict[int, int]] = {}  # layer -> expert -> forwards that needed it
        self.boundary: int | None = None  # store calls of the prefill; bytes_moved is sampled there
        self.bytes_at_boundary: int | None = None

    def fetch(self, layer: int, routing):
        if self.boundary is not None and len(self.calls) == self.boundary and self.bytes_at_boundary is None:
            self.bytes_at_boundary = self.bytes_moved  # everything before this call belongs to the prefill
        ids = routing.needed
        gen = self.inner.fetch(layer, routing)
        used = self.used.setdefault(layer, {})
        for e in ids:
            used[e] = used.get(e, 0) + 1
        wait = compute = 0.0
        try:
            while True:
                t0 = time.perf_counter()
                try:
                    item = next(gen)
                except StopIteration:
                    wait += time.perf_counter() - t0
                    break
                t1 = time.perf_counter()
                wait += t1 - t0
                yield item
                compute += time.perf_counter() - t1
        finally:
            self.calls.append((wait, compute, len(ids)))
            gen.close()


def prefill_forwards(prompt_lens: list[int]) -> int:
    """How many forwards the engine's prefill takes for these prompts (its MAX_PREFILL_TOKENS grouping)."""
    groups, n = 0, None
    for L in prompt_lens:
        if n is None or n + L > MAX_PREFILL_TOKENS:
            groups, n = groups + 1, 0
        n += L
    return groups


def jsonable(x):
    """Stats values to plain JSON (tensors and numpy arrays to lists, numbers to floats)."""
    try:
        import torch
        if isinstance(x, torch.Tensor):
            return x.tolist()
    except ImportError:
        pass
    if hasattr(x, "tolist") and not isinstance(x, (str, bytes)):
        return x.tolist()
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if isinstance(x, (int, float, str, bool)) or x is None:
        return x
    return str(x)


STAT_KEYS = ("bytes_moved", "bytes_per_token", "hits", "misses", "hit_rate", "fetch_wait_s", "tokens_per_step",
             "acceptance_per_position", "draft_time_s", "verify_time_s", "decode_steps", "prefill_time_s",
             "decode_time_s", "decoding")


def measure(llm, prompt_ids: list[list[int]], max_tokens: int, *, reference: list[list[int]] | None = None,
            instrument: bool = True) -> dict:
    """Greedy, EOS ignored (every system generates exactly the same number of tokens)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    gc.collect()
    llm.reset_stats()
    inner = llm.store
    timed = TimedStore(inner) if instrument else None
    if timed is not None:
        timed.boundary = prefill_forwards([len(p) for p in prompt_ids]) * len(llm.config.moe_layers)
        llm.store = timed
    try:
        t0 = time.perf_counter()
        outs = llm.generate(prompt_ids, params)
        wall = time.perf_counter() - t0
    finally:
        llm.store = inner
    st = llm.stats
    B = len(prompt_ids)
    gen = int(st["generated_tokens"])
    decode_tokens = gen - B  # the first token of each sequence comes from the prefill's logits
    row = {"batch": B, "generated_tokens": gen, "prompt_tokens": int(st["prompt_tokens"]), "wall_s": wall,
           "tokens_per_s": gen / wall if wall else None,
           "decode_tokens_per_s": decode_tokens / st["decode_time_s"] if st["decode_time_s"] else None}
    for k in STAT_KEYS:
        if k in st:
            row[k] = jsonable(st[k])
    if "bytes_moved" in st and gen:
        row["bytes_per_token"] = st["bytes_moved"] / gen
    if "expert_counts" in st:
        row["expert_counts"] = jsonable(st["expert_counts"])
    row["stats"] = {k: jsonable(v) for k, v in st.items() if k not in ("expert_counts",)}
    if timed is not None:
        layers = len(llm.config.moe_layers)
        skip = prefill_forwards([len(p) for p in prompt_ids]) * layers
        dec = timed.calls[skip:]
        row["breakdown"] = {
            "decode_time_s": st["decode_time_s"],
            "fetch_wait_s": sum(c[0] for c in dec),
            "expert_compute_s": sum(c[1] for c in dec),
            "draft_time_s": float(st.get("draft_time_s", 0.0) or 0.0),
            "decode_steps": int(st["decode_steps"]),
            "store_calls": len(dec),
            "prefill_fetch_wait_s": sum(c[0] for c in timed.calls[:skip]),
            "prefill_expert_compute_s": sum(c[1] for c in timed.calls[:skip]),
        }
        if timed.bytes_at_boundary is not None and "bytes_moved" in st:
            row["prefill_bytes"] = timed.bytes_at_boundary
            row["decode_bytes"] = st["bytes_moved"] - timed.bytes_at_boundary
            row["decode_bytes_per_token"] = row["decode_bytes"] / decode_tokens if decode_tokens else None
        E = llm.config.num_experts
        row["expert_forwards"] = {str(l): [c.get(e, 0) for e in range(E)] for l, c in sorted(timed.used.items())}
    if reference is not None:
        same = sum(o.token_ids == r for o, r in zip(outs, reference))
        row["matches_reference"] = same / B
    row["_token_ids"] = [o.token_ids for o in outs]
    return row


def decode_rate(gen, prompts: list[list[int]], n: int):
    """(decode tokens/s, what the n-token call returned) of `gen(prompts, k)`, a k-token generate: batch × (n − 1)
    over the wall of an n-token call minus that of a 1-token one, so prefill is out of it for any system alike."""
    import time
    t0 = time.perf_counter()
    gen(prompts, 1)
    t1 = time.perf_counter()
    out = gen(prompts, n)
    t2 = time.perf_counter()
    return len(prompts) * (n - 1) / max(1e-9, (t2 - t1) - (t1 - t0)), out
