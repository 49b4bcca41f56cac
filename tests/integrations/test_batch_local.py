"""`specmoe batch` without Ray (--num-workers 0 runs the same predictor in this process): resuming after a
killed run or a cut output, refusing a journal or output of another run, Parquet, the install hint, and
that the core never imports Ray."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from specmoe.integrations.predictor import apportion
from tests.integrations.conftest import ENGINE, MAX_TOKENS, batch, check_against_oracle, read_jsonl, write_rows

LOCAL = ["--num-workers", "0", "--max-tokens", MAX_TOKENS, *ENGINE]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    pass


def test_core_and_cli_do_not_import_ray():
    code = ("import sys, specmoe, specmoe.cli; specmoe.cli.build_parser(); "
            "assert not any(m == 'ray' or m.startswith('ray.') for m in sys.modules), 'ray imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_without_ray_batch_prints_the_install_hint(tmp_path, monkeypatch):
    for name in ("ray", "ray.data"):
        monkeypatch.setitem(sys.modules, name, None)  # `import ray` raises ImportError
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_rows(src, [{"prompt": "hi"}])
    rc, _, err = batch(src, dst)
    assert rc == 2 and "pip install 'specmoe[ray]'" in err and err.count("\n") == 1 and "Traceback" not in err
    assert not dst.exists() and not (tmp_path / "out.jsonl.partial").exists()


def test_in_process_run_equals_generate_with_error_rows(tmp_path, batch_rows, oracle):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_rows(src, batch_rows[0])
    rc, s, err = batch(src, dst, *LOCAL, "--batch-size", 32)
    assert rc == 0, err
    rows = read_jsonl(dst)
    check_against_oracle(rows, batch_rows, oracle)
    assert s["processed"] == len(rows) and s["errors"] == 4 and not (tmp_path / "out.jsonl.partial").exists()
    # every byte the engine moved is attributed to exactly one row
    assert s["expert_bytes"] == sum(r["expert_bytes"] for r in rows) > 0


def test_killed_run_resumes_without_redoing_or_duplicating(tmp_path, batch_rows, oracle):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    journal = tmp_path / "out.jsonl.partial"
    n = 96
    write_rows(src, batch_rows[0][:n])
    cmd = [sys.executable, "-m", "specmoe", "batch", src, dst, *LOCAL, "--batch-size", 8, "--json"]
    p = subprocess.Popen([str(c) for c in cmd], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and p.poll() is None:  # header + at least two batches journaled
            if journal.is_file() and journal.read_text().count("\n") >= 1 + 16:
                break
            time.sleep(0.05)
        assert p.poll() is None, "the run ended before it could be killed"
        os.kill(p.pid, signal.SIGKILL)
    finally:
        p.wait()
    assert not dst.exists()
    kept = sum(json.loads(line)["error"] is None for line in journal.read_text().splitlines()[1:])
    head, *done = journal.read_text().splitlines(keepends=True)
    # rows arrive in completion order (Ray workers finish batches out of order): the output must not follow it
    journal.write_text(head + "".join(reversed(done)) + '{"index": 95, "text": "cut')  # and a row cut by the kill
    rc, s, err = batch(src, dst, *LOCAL, "--batch-size", 8)
    assert rc == 0, err
    # nothing finished is redone (error rows are: they are cheap and may have been transient)
    assert s["resumed"] == kept >= 14 and s["processed"] == n - kept
    check_against_oracle(read_jsonl(dst), batch_rows, oracle, n)
    assert not journal.exists()


def test_cut_output_resumes(tmp_path, batch_rows, oracle):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_rows(src, batch_rows[0])
    assert batch(src, dst, *LOCAL)[0] == 0
    full = dst.read_text()
    lines = full.splitlines(keepends=True)
    dst.write_text("".join(lines[:120]) + lines[120][:30])  # 120 rows and a cut one
    rc, s, err = batch(src, dst, *LOCAL)
    assert rc == 0, err
    # error rows (4 of the first 120) are redone, finished ones are not
    assert s["resumed"] == 120 - sum(i < 120 for i in (7, 23, 41, 58)) and s["processed"] == 200 - s["resumed"]
    check_against_oracle(read_jsonl(dst), batch_rows, oracle)


def test_other_input_or_settings_are_refused(tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_rows(src, [{"id": 1, "prompt": "def add(a, b):"}, {"id": 2, "prompt": "And God said"}])
    journal = tmp_path / "out.jsonl.partial"
    journal.write_text(json.dumps({"specmoe_batch_journal": 1, "input_sha256": "0" * 64, "settings": {}}) + "\n")
    rc, _, err = batch(src, dst, *LOCAL)
    assert rc == 2 and "another input file" in err and "delete it" in err
    journal.unlink()
    assert batch(src, dst, *LOCAL)[0] == 0
    # the same input with another --max-tokens, interrupted: its journal is refused by the original settings
    journal.write_text(journal_header(src, dst, max_tokens=3))
    rc, _, err = batch(src, dst, *LOCAL)
    assert rc == 2 and "other settings (defaults)" in err
    journal.unlink()
    write_rows(src, [{"id": 1, "prompt": "another prompt"}, {"id": 2, "prompt": "And God said"}])
    rc, _, err = batch(src, dst, *LOCAL)
    assert rc == 2 and "written for another input" in err
    dst.write_text('{"text": "a file of the user\'s own"}\n')  # never overwritten
    rc, _, err = batch(src, dst, *LOCAL)
    assert rc == 2 and "not the output of `specmoe batch`" in err and "own" in dst.read_text()


def journal_header(src, dst, **defaults) -> str:
    from specmoe.integrations import batch_io
    from specmoe.integrations.offline import settings_of
    inputs = batch_io.read_input(src)
    d = {"max_tokens": MAX_TOKENS, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "seed": None, "stop": [], **defaults}
    llm = {"model": None, "dtype": "float32"}
    head = {"specmoe_batch_journal": 1, "input_sha256": inputs.sha256,
            "settings": batch_io.normalize(settings_of(llm, d))}
    return json.dumps(head) + "\n"


def test_parquet_in_and_out(tmp_path, oracle, batch_rows):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq
    inputs, good = batch_rows
    idx = [i for i in good][:12]
    src, dst = tmp_path / "in.parquet", tmp_path / "out.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": i, "prompt": good[i]} for i in idx]
                                        + [{"id": 99, "prompt": ""}]), src)
    rc, s, err = batch(src, dst, *LOCAL)
    assert rc == 0, err
    rows = pq.read_table(dst).to_pylist()
    assert [r["id"] for r in rows] == idx + [99]  # ids keep their type
    assert [r["token_ids"] for r in rows[:-1]] == [oracle[i].token_ids for i in idx]
    assert rows[-1]["error"] == "the prompt is empty"


def test_per_row_sampling_fields(tmp_path):
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_rows(src, [{"prompt": "def add(a, b):", "max_tokens": 3}, {"prompt": "def add(a, b):"},
                     {"prompt": "And God said", "temperature": 0.8, "seed": 5, "top_p": 0.9},
                     {"prompt": "And God said", "temperature": 0.8, "seed": 5, "top_p": 0.9},
                     {"prompt": "x", "stop": 3}, {"prompt": "x", "token_ids": [1, 2]}])
    assert batch(src, dst, *LOCAL)[0] == 0
    r = read_jsonl(dst)
    assert r[0]["generated_tokens"] == 3 and r[1]["generated_tokens"] == MAX_TOKENS
    assert r[1]["token_ids"][:3] == r[0]["token_ids"]
    assert r[2]["token_ids"] == r[3]["token_ids"]  # seeded rows repeat
    assert "stop must be" in r[4]["error"] and "not both" in r[5]["error"]


def test_apportion_adds_up():
    assert apportion(10, [1, 1, 1]) == [4, 3, 3]
    assert apportion(7, [0, 0]) == [4, 3] and apportion(0, []) == []
    parts = apportion(1_000_003, [5, 17, 1, 0, 9])
    assert sum(parts) == 1_000_003 and parts[3] == 0 and parts[1] > parts[4] > parts[0] > parts[2]


def test_predictor_takes_plain_rows_as_ray_data_gives_them():
    """A user's own Ray Data rows (a `prompt` column, any other columns) go through the same predictor."""
    pa = pytest.importorskip("pyarrow")
    from specmoe import LLM, SamplingParams
    from specmoe.integrations.predictor import SpecMoEPredictor, output_schema
    p = SpecMoEPredictor(llm={"dtype": "float32"}, defaults={"max_tokens": 4})
    table = pa.Table.from_pylist([{"prompt": "def add(a, b):", "domain": "code", "max_tokens": None},
                                  {"prompt": "", "domain": "x", "max_tokens": 2},
                                  {"prompt": "And God said", "domain": "bible", "max_tokens": 2}])
    out = p(table)
    assert out.schema == output_schema()
    rows = out.to_pylist()
    p.close()
    with LLM(dtype="float32") as llm:
        want = llm.generate(["def add(a, b):", "And God said"], [SamplingParams(max_tokens=4),
                                                                   SamplingParams(max_tokens=2)])
    assert [r["token_ids"] for r in rows] == [want[0].token_ids, None, want[1].token_ids]
    assert rows[1]["error"] == "the prompt is empty" and rows[0]["index"] is None


def test_a_failed_join_is_a_one_line_error(tmp_path, monkeypatch):
    """What Ray raises when a cluster refuses the token (seen with `ray start --head` and a client without
    RAY_AUTH_MODE=token): ConnectionError from the authentication error. ray.init is replaced here; a real
    unreachable address makes Ray retry for minutes."""
    ray = pytest.importorskip("ray")

    def refuse(**kw):
        try:
            raise RuntimeError("Failed to connect to GCS. InvalidAuthToken: Authentication token is missing")
        except RuntimeError as e:
            raise ConnectionError(f"Failed to connect to Ray cluster at {kw['address']}") from e

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", refuse)
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    write_rows(src, [{"prompt": "hi"}])
    rc, _, err = batch(src, dst, "--ray-address", "10.0.0.1:6379", "--max-tokens", 2)
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "cannot join the Ray cluster at 10.0.0.1:6379: Failed to connect" in err and "RAY_AUTH_MODE=token" in err


def test_ray_logs_stay_out_of_stdout(monkeypatch):
    """`specmoe batch --json` prints its summary on stdout; Ray must not forward workers' and raylets' log lines
    there (a forwarded "(raylet) Task ... submit failed" line once broke the summary after an interrupted run).
    Both ways of connecting ask Ray not to forward them."""
    ray = pytest.importorskip("ray")
    from specmoe.integrations import ray as rx
    seen = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: seen.append(kw))
    assert rx.connect(None, num_cpus=1) and rx.connect("10.0.0.1:6379")
    assert [kw.get("log_to_driver") for kw in seen] == [False, False]
