"""tokenizer.json / tokenizer_config.json: wrong shape, non-UTF-8, invalid JSON, not a tokenizer,
a bad eos_token entry. Each is a CheckpointError naming the file; no file changes."""
import pytest

from specmoe import LLM
from specmoe.errors import CheckpointError
from tests.validation.conftest import assert_one_line_error, run_cli, snapshot

TOKENIZER_CASES = [
    ("tokenizer.json", b"[]", "tokenizer.json must hold a JSON object, got a list"),
    ("tokenizer.json", b"null", "tokenizer.json must hold a JSON object, got null"),
    ("tokenizer.json", b'{"model": "\xff"}', "tokenizer.json is not UTF-8 text"),
    ("tokenizer.json", b'{"model": {', "tokenizer.json is not valid JSON"),
    ("tokenizer.json", b'{"model": {"type": "Nope"}}', "tokenizer.json is not a valid tokenizers file"),
    ("tokenizer.json", b"{}", "tokenizer.json is not a valid tokenizers file"),
    ("tokenizer_config.json", b'["eos"]', "tokenizer_config.json must hold a JSON object, got a list"),
    ("tokenizer_config.json", b'{"eos_token": "\xe9"}', "tokenizer_config.json is not UTF-8 text"),
    ("tokenizer_config.json", b'{"eos_token": 2}', "tokenizer_config.json: eos_token must be a string"),
    ("tokenizer_config.json", b'{"eos_token": {"content": 2}}', "tokenizer_config.json: eos_token must be"),
]


@pytest.mark.parametrize("name,data,needle", TOKENIZER_CASES,
                         ids=[f"{c[0].split('.')[0]}-{i}" for i, c in enumerate(TOKENIZER_CASES)])
def test_bad_tokenizer_file(text_ckpt, name, data, needle):
    (text_ckpt / name).write_bytes(data)
    before = snapshot(text_ckpt)
    with pytest.raises(CheckpointError) as e:
        LLM(text_ckpt)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert snapshot(text_ckpt) == before


def test_good_tokenizer_loads(text_ckpt):
    """The demo model's tokenizer, copied in: its template puts <|endoftext|> (id 0) first, "hello" is one token
    (6957) and " world" another (2236); without the template only the words' ids; decoding skips the special
    token and gives the text back."""
    llm = LLM(text_ckpt)
    tok = llm.tokenizer
    assert tok is not None
    assert tok.encode("hello") == [0, 6957]
    assert tok.encode("hello world") == [0, 6957, 2236] and tok.encode("hello world", special=False) == [6957, 2236]
    assert tok.encode_in_thread("hello") == [0, 6957]
    assert tok.decode([0, 6957, 2236]) == "hello world"


def test_cli_bad_tokenizer(text_ckpt):
    (text_ckpt / "tokenizer.json").write_bytes(b"[1, 2]")
    before = snapshot(text_ckpt)
    assert_one_line_error(run_cli("generate", "--model", text_ckpt, "--prompt", "hi", "--json"),
                          "specmoe: error:", "tokenizer.json must hold a JSON object, got a list")
    assert snapshot(text_ckpt) == before
