"""One speculative step for every drafter: rows drafted by self, eagle and ngram (and plain rows) verify in the
same forward, and the output is still the target's own: greedy equals plain greedy (fp32, batch 1 / 7 / 64),
seeded sampled rows equal plain seeded decoding, and unseeded sampled rows run (rejection sampling over
every drafter's q). The mix is forced per row and step, so every drafter really drafts in mixed batches;
`auto`'s own choices are checked to be reported in the stats."""
from __future__ import annotations

import pytest

from specmoe import LLM, SamplingParams
from specmoe.decoding.strategies.speculative import SpeculativeDecoder, StepPlan

from tests.decoding.eagle_cases import BATCHES, prompts

MIX = ("self", "eagle", "ngram", None)  # None: the row drafts nothing (a plain row inside the forward)


@pytest.fixture(scope="module")
def ar_llm():
    return LLM(dtype="float32", threads=1)


@pytest.fixture
def forced_mix(monkeypatch):
    """Every step, row b drafts with MIX[(b + step) % 4] (all rows of a step share no drafter pattern), γ as
    the limits allow; records which drafters drafted which rows in one step."""
    seen = []

    def plan(self, seqs):
        limits = [self.limit(s) for s in seqs]
        k = len(seen)
        who = [MIX[(b + k) % len(MIX)] for b in range(len(seqs))]
        seen.append(tuple(sorted({d for d, g in zip(who, limits) if d and g})))
        return StepPlan(who, limits)
    monkeypatch.setattr(SpeculativeDecoder, "plan", plan)
    return seen


def auto_llm(**kw):
    return LLM(dtype="float32", threads=1, decoding="auto", num_draft_tokens=3, offload="host", cache_experts=8,
               **kw)


@pytest.mark.parametrize("batch", [1, 7, 64])
def test_mixed_drafters_greedy_equals_plain(ar_llm, forced_mix, batch):
    ps, sp = BATCHES[batch]
    ref = [o.token_ids for o in ar_llm.generate(ps, sp)]
    llm = auto_llm()
    assert [o.token_ids for o in llm.generate(ps, sp)] == ref
    st = llm.stats
    if batch > 1:  # several drafters in one verification forward
        assert any(len(m) >= 2 for m in forced_mix), forced_mix[:5]
    drafted = {n: d["rows"] for n, d in st["drafters"].items()}
    assert all(drafted[n] > 0 for n in ("self", "eagle")), drafted  # ngram may find no match at batch 1
    if batch == 64:
        assert drafted["ngram"] > 0
    rejected = st["drafted_tokens"] - st["accepted_tokens"]
    assert st["accepted_tokens"] > 0 and rejected > 0, "drafts were both accepted and rejected"


def test_mixed_drafters_seeded_rows_equal_plain_seeded_and_unseeded_rows_run(ar_llm, forced_mix):
    ps = prompts(12)
    seeded = [SamplingParams(max_tokens=12, temperature=0.8, seed=s, ignore_eos=True) for s in range(12)]
    ref = [o.token_ids for o in ar_llm.generate(ps, seeded)]
    llm = auto_llm()
    assert [o.token_ids for o in llm.generate(ps, seeded)] == ref
    unseeded = [SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True) for _ in range(12)]
    outs = llm.generate(ps, unseeded)
    assert all(len(o.token_ids) == 12 for o in outs)
    st = llm.stats
    assert all(st["drafters"][n]["rows"] > 0 for n in ("self", "eagle")), st["drafters"]


@pytest.fixture
def step_log(monkeypatch):
    """What the decoder did, recorded from outside its accounting: per speculative step (drafter of each row,
    its tree's size, the tokens it emitted, the step's expert bytes), and the plain steps."""
    log = {"spec": [], "plain": 0}
    record, plain_step = SpeculativeDecoder._record, SpeculativeDecoder.plain_step

    def _record(self, plan, trees, out, clock, step_bytes):
        log["spec"].append((list(plan.drafter_of), [len(t) for t in trees], [len(o) for o in out], step_bytes))
        return record(self, plan, trees, out, clock, step_bytes)

    def _plain(self, seqs, clock):
        log["plain"] += 1
        return plain_step(self, seqs, clock)
    monkeypatch.setattr(SpeculativeDecoder, "_record", _record)
    monkeypatch.setattr(SpeculativeDecoder, "plain_step", _plain)
    return log


def test_auto_reports_what_it_chose(step_log):
    """The stats are what the steps did: plain and speculative step counts and share, per drafter the rows it
    drafted, their tokens (drafted, accepted, emitted per row) and their share of the step's expert bytes."""
    llm = auto_llm()
    ps, sp = BATCHES[7]
    llm.generate(ps, sp)
    st = llm.stats
    assert st["decoding"] == "auto" and set(st["drafters"]) == {"self", "eagle", "ngram"}
    spec, plain = step_log["spec"], step_log["plain"]
    assert spec and st["ar_steps"] == plain and st["steps"] == len(spec)
    assert st["plain_step_share"] == plain / (plain + len(spec))
    assert st["controller_steps"] == {"plain": plain, "spec": len(spec)}  # one choice per step, coasting included
    for name, d in st["drafters"].items():
        rows = [(n, e, b / len(ds)) for ds, ns, es, b in spec for who, n, e in zip(ds, ns, es) if who == name and n]
        emitted = sum(e for _, e, _ in rows)
        assert d["rows"] == len(rows) and d["drafted_tokens"] == sum(n for n, _, _ in rows), name
        assert d["accepted_tokens"] == emitted - len(rows), name
        assert d["tokens_per_step"] == pytest.approx(emitted / len(rows) if rows else 0.0), name
        assert d["expert_bytes_per_token"] == pytest.approx(sum(b for *_, b in rows) / emitted if emitted else 0.0)
    assert sum(d["rows"] for d in st["drafters"].values()) > 0


def test_verification_leaves_out_the_observers_of_drafters_it_does_not_use():
    """A verification that only the ngram drafter's rows take part in runs without the self drafter's observers
    (its draft-set counts see only the verifications it drafted for); one with self keeps them."""
    llm = auto_llm()
    with llm.engine(None) as core:
        dec = core.strategy
        own = dec.drafters["self"].target_observers()
        assert own
        with_self = dec._context([dec.drafters["self"]]).observers
        without = dec._context([dec.drafters["ngram"]]).observers
        assert all(o in with_self for o in own)
        assert not any(o in without for o in own), "the self drafter's observers ran in a forward it took no part in"
