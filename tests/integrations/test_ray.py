"""`specmoe batch` on Ray Data: a local Ray instance with 2 CPUs (conftest's, started once), two workers
(one engine each). Output equals `LLM.generate` row for row, in input order, none lost or duplicated,
bad rows are error rows, and an interrupted run restarts without redoing or duplicating rows."""
from __future__ import annotations

import pytest

from tests.integrations.conftest import ENGINE, MAX_TOKENS, batch, check_against_oracle, read_jsonl, write_rows

pytest.importorskip("ray.data")

BATCH = 25  # 200 rows: 8 batches over the workers
SPEC = ["--decoding", "specmoe", "--draft-experts", "4", "--num-draft-tokens", "3"]


@pytest.fixture(autouse=True)
def _ray(local_ray):
    pass


def test_two_workers_equal_generate_in_input_order(tmp_path, batch_rows, oracle, monkeypatch):
    """SpecMoE decoding on the workers, plain AR in the oracle: greedy fp32 output must agree token for token.
    The workers read one disk-tier repack, built by the driver before they start."""
    from specmoe.integrations import ray as rx
    src, dst, repack = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "repack"
    write_rows(src, batch_rows[0])
    repack.mkdir()
    real = rx.run_batches

    def after_the_repack(*a, **kw):
        assert len(list(repack.glob("experts-*.json"))) == 1, "the workers start before the shared repack exists"
        yield from real(*a, **kw)

    monkeypatch.setattr(rx, "run_batches", after_the_repack)
    disk = ["--offload", "disk", "--repack-dir", repack, "--cache-experts", 8, "--dtype", "float32"]
    rc, s, err = batch(src, dst, "--num-workers", 2, "--batch-size", BATCH, "--max-tokens", MAX_TOKENS, *disk, *SPEC)
    assert rc == 0, err
    assert len(list(repack.glob("experts-*"))) == 2  # one data file + its manifest, nothing else written
    rows = read_jsonl(dst)
    check_against_oracle(rows, batch_rows, oracle)  # also: bad rows are error rows with the reason
    assert s["errors"] == 4 and s["processed"] == len(rows) and not (tmp_path / "out.jsonl.partial").exists()
    ok = [r for r in rows if r["error"] is None]
    assert len(s["workers"]) == 2 and {r["worker"] for r in ok} == set(s["workers"])  # both engines worked
    assert s["expert_bytes"] == sum(r["expert_bytes"] for r in rows) > 0
    assert all(1 <= r["tokens_per_step"] <= 4 for r in ok)  # τ of a speculative batch, γ = 3


def test_interrupted_run_restarts_without_duplicates(tmp_path, batch_rows, oracle, monkeypatch):
    from specmoe.integrations import ray as rx
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_rows(src, batch_rows[0])
    real = rx.run_batches

    def two_then_interrupt(*a, **kw):
        for n, rows in enumerate(real(*a, **kw)):
            if n == 2:
                raise KeyboardInterrupt
            yield rows

    monkeypatch.setattr(rx, "run_batches", two_then_interrupt)
    args = [src, dst, "--num-workers", 1, "--batch-size", BATCH, "--max-tokens", MAX_TOKENS, *ENGINE]
    rc, _, err = batch(*args)
    assert rc == 130 and "rerun the same command" in err and not dst.exists()
    journal = read_jsonl(tmp_path / "out.jsonl.partial")[1:]
    assert len(journal) == 2 * BATCH
    monkeypatch.setattr(rx, "run_batches", real)
    # the restart runs the same predictor in this process (one Ray worker start less for the suite); what it
    # resumes from is the journal the interrupted Ray run left
    rc, s, err = batch(*args[:3], 0, *args[4:])
    assert rc == 0, err
    kept = sum(r["error"] is None for r in journal)
    assert s["resumed"] == kept and s["processed"] == len(batch_rows[0]) - kept  # nothing finished redone
    check_against_oracle(read_jsonl(dst), batch_rows, oracle)
