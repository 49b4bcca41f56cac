"""Prompts: bytes, tensors, generators, dicts, mixed lists, non-integer or boolean ids, lone
surrogates, and JSONL prompt files (integer prompts must not merge into one prompt). Each bad
one is an InputError naming the prompt and what was expected; no file changes."""
import json

import numpy as np
import pytest
import torch

from specmoe import LLM, SamplingParams
from specmoe.errors import InputError
from tests.validation.conftest import NO_REPACK, assert_one_line_error, main_error, run_cli, snapshot

# (case id, prompts argument, text the message must contain)
PROMPT_CASES = [
    ("bytes", b"hello", "got bytes; decode bytes to str first"),
    ("bytes_in_batch", ["a", b"b"], "prompt 1 is bytes; each prompt must be a string or a list of token ids"),
    ("bytearray", bytearray(b"hi"), "got bytearray"),
    ("tensor", torch.tensor([1, 2, 3]), "got torch.Tensor; pass token ids as a Python list (tensor.tolist())"),
    ("tensor_in_batch", [torch.tensor([1, 2])], "prompt 0 is torch.Tensor"),
    ("numpy_array", np.array([1, 2]), "got numpy.ndarray"),
    ("generator", (p for p in ["a", "b"]), "got generator; pass a list"),
    ("dict", {"prompt": "hi"}, "got dict; pass the prompt text itself"),
    ("dict_in_batch", [{"prompt": "hi"}], "prompt 0 is dict"),
    ("set", {1, 2}, "got set"),
    ("none", None, "got NoneType"),
    ("int", 5, "got int"),
    ("ids_then_list", [1, [2, 3]], "prompt 0: token ids must be integers; item 1 is list"),
    ("ids_then_str", [1, "a"], "prompt 0: token ids must be integers; item 1 is str"),
    ("str_then_int", ["a", 3], "prompt 1 is int"),
    ("float_ids", [1.0, 2.0], "prompt 0: token ids must be integers; item 0 is float 1.0"),
    ("float_id_in_batch", [[1, 2], [3, 4.5]], "prompt 1: token ids must be integers; item 1 is float 4.5"),
    ("bool_ids", [True, False], "prompt 0: token ids must be integers; item 0 is a boolean"),
    ("bool_id_in_list", [[1, True]], "prompt 0: token ids must be integers; item 1 is a boolean"),
    ("str_id", [["1", "2"]], "prompt 0: token ids must be integers; item 0 is str"),
    ("nested_list", [[[1, 2]]], "prompt 0: token ids must be integers; item 0 is list"),
    ("none_id", [[1, None]], "item 1 is NoneType"),
    ("negative_id", [[1, -1]], "outside the vocabulary [0, 96): [-1]"),
    ("huge_id", [2**70], "outside the vocabulary"),
    ("empty_list", [], "empty prompt list"),
    ("empty_prompt", [[1], []], "prompt 1 is empty"),
    ("too_long", [[1] * 300], "context length is 256"),
]


@pytest.fixture(scope="module")
def llm(tiny_ckpt):
    return LLM(tiny_ckpt("qwen3_moe"), max_batch=4)


@pytest.mark.parametrize("prompts,needle", [c[1:] for c in PROMPT_CASES], ids=[c[0] for c in PROMPT_CASES])
def test_bad_prompt(llm, prompts, needle):
    before = snapshot(llm.path)
    with pytest.raises(InputError) as e:
        llm.generate(prompts, SamplingParams(max_tokens=2))
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
    if not hasattr(prompts, "__next__"):  # a generator is consumed by the first call
        with pytest.raises(InputError):
            llm.logits(prompts)
    assert snapshot(llm.path) == before


def test_accepted_prompt_forms(llm):
    """Control: one id list, a tuple, numpy integer ids and a batch of lists are the same prompts."""
    p = SamplingParams(max_tokens=3, ignore_eos=True)
    ref = llm.generate([[5, 6, 7]], p)[0].token_ids
    assert llm.generate([5, 6, 7], p)[0].token_ids == ref
    assert llm.generate((5, 6, 7), p)[0].token_ids == ref
    assert llm.generate([np.int64(5), np.int32(6), 7], p)[0].token_ids == ref
    outs = llm.generate([[5, 6, 7], (5, 6, 7)], p)
    assert [o.token_ids for o in outs] == [ref, ref]


@pytest.fixture(scope="module")
def text_llm(tmp_path_factory, tiny_ckpt):
    import shutil

    from specmoe.engine.llm import DEMO_MODEL
    d = tmp_path_factory.mktemp("text") / "ckpt"
    shutil.copytree(tiny_ckpt("qwen3_moe", vocab_size=8192), d, ignore=NO_REPACK)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEMO_MODEL / name, d / name)
    return LLM(d, max_batch=4)


@pytest.mark.parametrize("prompts,needle", [
    ("ab\ud800cd", "prompt 0 is not valid Unicode text (a lone surrogate at character 2)"),
    (["ok", "\udfff"], "prompt 1 is not valid Unicode text (a lone surrogate at character 0)"),
], ids=["lone_high_surrogate", "lone_low_surrogate_in_batch"])
def test_lone_surrogate(text_llm, prompts, needle):
    with pytest.raises(InputError) as e:
        text_llm.generate(prompts, SamplingParams(max_tokens=2))
    assert needle in str(e.value)


def test_text_and_ids_batch_still_works(text_llm):
    out = text_llm.generate(["def f(x):", [1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert out[0].prompt == "def f(x):" and out[1].prompt is None and all(len(o.token_ids) == 2 for o in out)


# ------------------------------------------------------------------ prompt files (CLI)
def jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.mark.parametrize("rows,needle", [
    ([{"prompt": 5}, {"prompt": 7}], "p.jsonl:1: expected a JSON object whose 'prompt' is a string or a list of "
                                     "token ids; got 'prompt' is 5"),
    ([{"prompt": [1, 2]}, {"prompt": 7.5}], "p.jsonl:2:"),
    ([{"prompt": [1, True]}], "p.jsonl:1:"),
    ([{"prompt": []}], "p.jsonl:1:"),
    ([{"text": "x"}], "p.jsonl:1: expected a JSON object whose 'prompt' is a string or a list of token ids; "
                      "got no 'prompt' field"),
    ([["x"]], "got no 'prompt' field"),
    ([None], "got no 'prompt' field"),
], ids=["integer_prompts", "float_prompt", "bool_id", "empty_ids", "no_prompt_field", "row_is_list", "row_null"])
def test_cli_bad_jsonl(tmp_path, ckpt, capsys, rows, needle):
    f = jsonl(tmp_path / "p.jsonl", rows)
    before = snapshot(ckpt)
    assert needle in main_error(capsys, "generate", "--model", ckpt, "--prompts-file", f)
    assert snapshot(ckpt) == before


def test_cli_bad_prompt_files(tmp_path, ckpt, capsys):
    bad = tmp_path / "p.txt"
    bad.write_bytes(b"hello \xff\xfe world\n")
    assert "is not UTF-8 text (invalid byte at offset 6)" in main_error(
        capsys, "generate", "--model", ckpt, "--prompts-file", bad)
    (tmp_path / "q.jsonl").write_text('{"prompt": "a"}\n{"prompt": \n')
    assert "q.jsonl:2: expected a JSON object" in main_error(
        capsys, "generate", "--model", ckpt, "--prompts-file", tmp_path / "q.jsonl")
    assert "prompts file not found" in main_error(capsys, "generate", "--model", ckpt, "--prompts-file", tmp_path)
    prof = tmp_path / "prof.jsonl"
    prof.write_text('{"prompt": [1, 2]}\n')  # profile needs text
    assert "prof.jsonl:1: expected a JSON object whose 'prompt' is a string; got 'prompt' is [1, 2]" in main_error(
        capsys, "profile", "--model", ckpt, "--prompts", prof, "--out-dir", tmp_path / "out")


def test_cli_jsonl_id_prompts_are_a_batch(tmp_path, ckpt):
    """Rows whose prompts are token-id lists stay separate prompts; rows of bare integers are refused
    (they used to merge into one token-id prompt)."""
    f = jsonl(tmp_path / "ids.jsonl", [{"prompt": [5]}, {"prompt": [7, 8]}])
    before = snapshot(ckpt)
    p = run_cli("generate", "--model", ckpt, "--prompts-file", f, "--max-tokens", "2", "--json")
    assert p.returncode == 0, p.stderr
    outs = json.loads(p.stdout)["outputs"]
    assert len(outs) == 2 and all(len(o["token_ids"]) <= 2 for o in outs)
    assert_one_line_error(run_cli("generate", "--model", ckpt, "--prompts-file",
                                  jsonl(tmp_path / "ints.jsonl", [{"prompt": 5}, {"prompt": 7}])),
                          "ints.jsonl:1:", "got 'prompt' is 5")
    assert snapshot(ckpt) == before
