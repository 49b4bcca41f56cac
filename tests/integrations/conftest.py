"""Inputs and the oracle for `specmoe batch`: short prompts from the held-out benchmark prompts, with bad
rows at fixed places, and `LLM.generate` over the good rows in one process (greedy, fp32)."""
from __future__ import annotations

import contextlib
import io
import json

import pytest
import torch

from specmoe.bundled import prompts_dir

MAX_TOKENS = 6
# fp32: greedy output does not depend on batch composition or on speculation (bf16 rounds near ties)
ENGINE = ["--dtype", "float32", "--offload", "host", "--cache-experts", "8", "--threads", "1"]
BAD = {7: ({"id": "empty", "prompt": ""}, "the prompt is empty"),
       23: ({"id": "long", "token_ids": [5] * 1024}, "context length is 1024"),
       41: ({"id": "hot", "prompt": "x", "temperature": -1.0}, "temperature must be"),
       58: ("this line is not JSON", "not valid JSON")}


def short_prompts(n: int) -> list[dict]:
    """n rows {"id", "prompt"}: the first 40 characters of the bundled prompts, cycling the four domains."""
    files = sorted(prompts_dir().glob("*.jsonl"))
    per = [[json.loads(line) for line in f.read_text().splitlines() if line.strip()] for f in files]
    rows = []
    for i in range(n):
        src = per[i % len(per)][i // len(per)]
        rows.append({"id": f"{src['id']}", "prompt": src["prompt"][:40]})
    return rows


def write_rows(path, rows) -> None:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def batch(*args) -> tuple[int, dict | None, str]:
    """`specmoe batch ... --json` in this process: (exit status, the JSON summary, stderr). The summary is read from
    its first line (`{`): a Ray driver thread left by an earlier run in this process (an interrupted one's error
    listener) may still print a "(raylet) Task ... submit failed" line to this call's redirected stdout, which a
    fresh `specmoe batch` process never sees."""
    from specmoe.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["batch", *map(str, args), "--json"])
    if rc != 0:
        return rc, None, err.getvalue()
    lines = out.getvalue().splitlines()
    return rc, json.loads("\n".join(lines[lines.index("{"):])), err.getvalue()


@pytest.fixture(scope="package")
def local_ray():
    """One local Ray instance with 2 CPUs for the Ray modules of this package (Ray Data, then Serve): it
    starts once, not once per module, and stops after the package's last test."""
    pytest.importorskip("ray")
    from specmoe.integrations import ray as rx
    started = rx.connect(num_cpus=2)
    yield
    if started:
        rx.shutdown()


@pytest.fixture(scope="session")
def batch_rows():
    """(input rows with the BAD rows in place, {index: prompt} of the good ones)."""
    rows = short_prompts(200)
    good = {}
    for i, r in enumerate(rows):
        if i in BAD:
            rows[i] = BAD[i][0]
        else:
            good[i] = r["prompt"]
    return rows, good


@pytest.fixture(scope="session")
def oracle(batch_rows):
    """{index: RequestOutput} from one LLM.generate call over every good row (plain AR, greedy, fp32)."""
    from specmoe import LLM, SamplingParams
    _, good = batch_rows
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with LLM(dtype="float32") as llm:
            outs = llm.generate(list(good.values()), SamplingParams(max_tokens=MAX_TOKENS))
    finally:
        torch.set_num_threads(n)
    return dict(zip(good, outs))


def check_against_oracle(rows: list[dict], batch_rows, oracle, n: int | None = None) -> None:
    """One output row per input row (the first n), in input order, each equal to the oracle or the expected
    error."""
    inputs, good = batch_rows
    assert [r["index"] for r in rows] == list(range(n or len(inputs)))
    for i, r in enumerate(rows):
        if i in BAD:
            assert r["error"] and BAD[i][1] in r["error"] and r["token_ids"] is None, r
            continue
        o = oracle[i]
        assert r["error"] is None and r["id"] == inputs[i]["id"] and r["prompt"] == good[i]
        assert (r["token_ids"], r["text"], r["finish_reason"]) == (o.token_ids, o.text, o.finish_reason), i
