"""Sampling: greedy, temperature, top-k, top-p, per-request seeds.

Three rules pick a token from a row of logits:
- greedy (temperature 0): argmax;
- seeded (a `seed` is set): the Gumbel-max trick with noise that is a pure function of
  (seed, output position): token = argmax(log p + g(seed, i)). It is an exact sample from p,
  and because the noise depends on nothing else, a seeded request's tokens depend only on
  its own logits: not on its batch neighbours, on the decoding mode, or on a draft model
  (SpecMoE drafts with the same noise and accepts a draft iff it equals the target's pick,
  which makes speculative output equal plain sampled output token for token);
- unseeded: a categorical draw from the request's own generator (speculative steps use
  rejection sampling, which accepts more drafts than the coupled rule).

A request may instead be *forced* (`forced_tokens`, greedy only): its output token i is forced_tokens[i] whatever
the logits say. The model still reads every forced token, so the expert traffic is that of the model reading the
document (teacher forcing); speculative modes draft greedily and accept a draft where it equals the forced token,
which prices acceptance pessimistically (a draft the model would accept but the document contradicts is rejected).
Benchmarks use it to decode natural text instead of the loops greedy decoding falls into.

`probs_from_logits` is shared with speculative decoding, whose acceptance rules must
compare draft and target distributions after exactly the same filtering."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from specmoe.errors import InputError, NonFiniteLogitsError

# V=vocab


@dataclass
class SamplingParams:
    """Per-request generation settings (vLLM-compatible names)."""
    max_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    # teacher forcing: output token i is forced_tokens[i] (temperature 0; at least max_tokens of them)
    forced_tokens: list[int] | None = None

    def __post_init__(self):
        from specmoe.options import SEED_RANGE, check_int, check_number
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(x, str) for x in self.stop):
            raise InputError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if any(x == "" for x in self.stop):
            raise InputError("stop strings must be non-empty (an empty stop string would match at once)")
        self.stop = list(self.stop)
        check_int("max_tokens", self.max_tokens, 1)
        check_number("temperature", self.temperature, lo_open=False)
        check_number("top_p", self.top_p, hi=1.0)
        check_int("top_k", self.top_k, 0)
        check_int("seed", self.seed, *SEED_RANGE, none_ok=True)
        if not isinstance(self.ignore_eos, bool):
            raise InputError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        if self.forced_tokens is not None:
            f = self.forced_tokens
            if isinstance(f, torch.Tensor):
                f = f.tolist()
            if not isinstance(f, (list, tuple)) or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                           for t in f):
                raise InputError("forced_tokens must be a list of non-negative token ids")
            if self.temperature != 0:
                raise InputError(f"forced_tokens needs temperature 0 (the output is the forced tokens), got "
                                 f"temperature={self.temperature}")
            if len(f) < self.max_tokens:
                raise InputError(f"forced_tokens holds {len(f)} tokens, fewer than max_tokens={self.max_tokens}")
            self.forced_tokens = list(f)

    def forced_at(self, position: int) -> int:
        """The forced output token at output position `position` (a forced request only)."""
        f = self.forced_tokens
        return f[position] if position < len(f) else f[-1]  # past the end only for a step the engine truncates

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def probs_from_logits(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits [..., V] → probabilities after temperature, top-k and top-p (fp32). The row's maximum is
    subtracted before dividing by the temperature, so a tiny positive temperature (logits / 1e-45 would
    overflow to inf and softmax to NaN) gives the greedy limit: the top token (or its ties) gets all the mass."""
    logits = logits.float()
    logits = (logits - logits.amax(-1, keepdim=True)) / p.temperature
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_p, idx = torch.sort(probs, dim=-1, descending=True)
        cum = sorted_p.cumsum(-1)
        drop = cum - sorted_p > p.top_p  # keep the smallest prefix whose mass reaches top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, idx, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


_MASK64 = (1 << 64) - 1


def _mix(seed: int, index: int) -> int:
    """splitmix64 of (seed, index): decorrelated generator seeds for neighbouring positions."""
    z = (seed * 0x9E3779B97F4A7C15 + (index + 1) * 0xD1B54A32D192ED03) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def coupled_noise(seed: int, start: int, n: int, vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Gumbel noise [n, V] of output positions start .. start+n-1 of a request seeded with `seed`:
    a pure function of (seed, position), whatever else runs."""
    g = torch.Generator(device=device)
    rows = []
    for i in range(start, start + n):
        g.manual_seed(_mix(seed, i))
        rows.append(torch.rand(vocab, generator=g, device=device))
    u = torch.stack(rows).clamp_(min=1e-20)
    return -torch.log(-torch.log(u))


def coupled_pick(logits: torch.Tensor, p: SamplingParams, noise: torch.Tensor) -> torch.Tensor:
    """Seeded rule: argmax(log p + g) over logits [..., V] with Gumbel noise [..., V] → token ids [...]."""
    return (torch.log(probs_from_logits(logits, p)) + noise).argmax(-1)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    g = torch.Generator(device=device)
    if seed is None:
        g.seed()
    else:
        g.manual_seed(seed)
    return g


def check_finite(finite: list[bool], what: str = "sequence") -> None:
    """Raise if any row's logits were not all finite (`finite` is already on the host)."""
    bad = [i for i, ok in enumerate(finite) if not ok]
    if bad:
        raise NonFiniteLogitsError(
            f"the model produced non-finite logits (inf/NaN) for {len(bad)} of {len(finite)} {what}(s) "
            f"(rows {bad[:5]}); nothing was sampled. The checkpoint's weights overflow or are corrupt "
            "(with float16, try dtype='float32' or 'bfloat16')")


def finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """[...] bool, on the logits' device: the row [..., V] holds no inf/NaN. NaN propagates through amax, and
    max|x| < inf is False for inf and NaN alike: exact, in three ops."""
    return logits.abs().amax(-1) < float("inf")


def sample(logits: torch.Tensor, params: list[SamplingParams], gens: list[torch.Generator],
           positions: list[int]) -> list[int]:
    """One token per row of logits [B, V]; `positions[b]` is the output index of row b's new token.
    Greedy rows take argmax, seeded rows the coupled rule, unseeded rows draw with their own generator,
    so a request's tokens never depend on what else is in the batch. Rows with inf/NaN logits raise
    NonFiniteLogitsError: for a greedy batch the check rides on the one host read of the tokens."""
    ok = finite_rows(logits)
    if not all(p.greedy for p in params):
        check_finite(ok.tolist())  # before a sampler meets NaN (torch.multinomial raises on it)
    out = logits.argmax(-1)
    for b, p in enumerate(params):
        if p.forced_tokens is not None:
            out[b] = p.forced_at(positions[b])
            continue
        if p.greedy:
            continue
        if p.seed is not None:
            out[b] = coupled_pick(logits[b], p, coupled_noise(p.seed, positions[b], 1, logits.shape[-1],
                                                               logits.device)[0])
        else:
            out[b] = torch.multinomial(probs_from_logits(logits[b], p), 1, generator=gens[b])[0]
    toks = torch.where(ok, out, -1).tolist()  # one host read: tokens, -1 marking a non-finite row
    check_finite([t >= 0 for t in toks])
    return toks
