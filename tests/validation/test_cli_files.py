"""CLI boundary: usage errors, prompt files and a checkpoint's expert_profile.json are one line on
stderr with exit 2, never a traceback (prompt-file rows: see test_prompts.py)."""
import json
import shutil

import pytest

from tests.validation.conftest import assert_one_line_error, main_error, run_cli, snapshot


@pytest.mark.parametrize("data,needle", [
    (b"\xff\xfe", "expert_profile.json is not UTF-8 text"),
    (b"{", "expert_profile.json is not valid JSON"),
    (b"null", "expert_profile.json must hold a JSON object, got null"),
    (json.dumps({"counts": [[1, 2]]}).encode(), "has shape 1×2; the model has 3 MoE layers × 8 experts"),
    (json.dumps({"counts": [["x"] * 8] * 3}).encode(), "each count must be an integer >= 0"),
    (json.dumps({"counts": [[None] * 8] * 3}).encode(), "is null; each count must be an integer >= 0"),
], ids=["non_utf8", "bad_json", "null", "wrong_shape", "string_counts", "null_counts"])
def test_inspect_bad_profile(ckpt, capsys, data, needle):
    (ckpt / "expert_profile.json").write_bytes(data)
    before = snapshot(ckpt)
    assert needle in main_error(capsys, "inspect", ckpt)
    assert snapshot(ckpt) == before


@pytest.mark.parametrize("args,needle", [
    (["generate", "--max-tokens"], "argument --max-tokens: expected one argument"),
    (["generate", "--offload", "ssd"], "argument --offload: invalid choice: 'ssd'"),
    (["nonsense"], "invalid choice: 'nonsense'"),
    (["generate", "--top-k", "1.5"], "argument --top-k: invalid int value: '1.5'"),
    (["profile", "--max-prompts", "0"], "--max-prompts must be >= 1, got 0"),
    (["generate", "--memory-budget", "0"], "argument --memory-budget: invalid size value: '0'"),
], ids=["missing_value", "bad_choice", "bad_command", "float_for_int", "profile_zero_prompts", "zero_size"])
def test_usage_errors_are_one_line(capsys, args, needle):
    err = main_error(capsys, *args)
    assert needle in err and ("--help" in err or args[0] == "profile"), err


def test_usage_error_subprocess(tmp_path):
    p = run_cli("generate", "--threads", "many")
    assert_one_line_error(p, "specmoe generate: error: argument --threads: invalid int value: 'many'")


def test_good_profile_still_inspected(ckpt, tiny_ckpt):
    (ckpt / "expert_profile.json").write_text(json.dumps({"counts": [[1] * 8] * 3}))
    p = run_cli("inspect", ckpt, "--json")
    assert p.returncode == 0, p.stderr
    assert len(json.loads(p.stdout)["skewness_per_layer"]) == 3
    shutil.rmtree(ckpt / ".specmoe", ignore_errors=True)
