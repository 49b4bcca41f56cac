"""SamplingParams: wrong types, NaN/inf, out-of-range values, empty stop strings. Each is an
InputError naming the field, raised when the params are made (before any model runs)."""
import math

import pytest

from specmoe import LLM, SamplingParams
from specmoe.errors import InputError
from tests.validation.conftest import assert_one_line_error, main_error, run_cli, snapshot

NAN, INF = math.nan, math.inf

PARAM_CASES = [
    ("max_tokens_zero", dict(max_tokens=0), "max_tokens must be an integer >= 1, got 0"),
    ("max_tokens_float", dict(max_tokens=8.0), "max_tokens must be an integer >= 1, got 8.0"),
    ("max_tokens_bool", dict(max_tokens=True), "max_tokens must be an integer >= 1, got True"),
    ("max_tokens_string", dict(max_tokens="8"), "max_tokens must be an integer >= 1, got '8'"),
    ("temperature_nan", dict(temperature=NAN), "temperature must be a finite number >= 0, got nan"),
    ("temperature_inf", dict(temperature=INF), "temperature must be a finite number >= 0, got inf"),
    ("temperature_negative", dict(temperature=-0.5), "temperature must be a finite number >= 0, got -0.5"),
    ("temperature_string", dict(temperature="0.7"), "temperature must be a finite number >= 0, got '0.7'"),
    ("top_p_zero", dict(top_p=0.0), "top_p must be a finite number > 0 and <= 1, got 0.0"),
    ("top_p_above_one", dict(top_p=1.5), "top_p must be a finite number > 0 and <= 1, got 1.5"),
    ("top_p_nan", dict(top_p=NAN), "top_p must be a finite number > 0 and <= 1, got nan"),
    ("top_k_negative", dict(top_k=-1), "top_k must be an integer >= 0, got -1"),
    ("top_k_float", dict(top_k=2.5), "top_k must be an integer >= 0, got 2.5"),
    ("seed_float", dict(seed=1.0), "seed must be an integer"),
    ("seed_too_big", dict(seed=2**64), "seed must be an integer in"),
    ("stop_empty", dict(stop=""), "stop strings must be non-empty"),
    ("stop_empty_in_list", dict(stop=["ok", ""]), "stop strings must be non-empty"),
    ("stop_int", dict(stop=3), "stop must be a string or a list of strings, got 3"),
    ("stop_list_of_int", dict(stop=[3]), "stop must be a string or a list of strings"),
    ("ignore_eos_string", dict(ignore_eos="no"), "ignore_eos must be True or False"),
]


@pytest.mark.parametrize("kw,needle", [c[1:] for c in PARAM_CASES], ids=[c[0] for c in PARAM_CASES])
def test_bad_sampling_params(kw, needle):
    with pytest.raises(InputError) as e:
        SamplingParams(**kw)
    assert needle in str(e.value), str(e.value)


def test_generate_refuses_bad_params_list(ckpt):
    llm = LLM(ckpt, max_batch=2)
    before = snapshot(ckpt)
    with pytest.raises(InputError, match="params must be a SamplingParams or a list of them, got dict"):
        llm.generate([[1, 2]], {"max_tokens": 4})
    with pytest.raises(InputError, match="2 SamplingParams for 1 prompts"):
        llm.generate([[1, 2]], [SamplingParams(), SamplingParams()])
    with pytest.raises(InputError, match="params must be a SamplingParams or a list of them"):
        llm.generate([[1, 2]], [None])
    # control: valid params (tuples, a stop string, an integer temperature) work
    out = llm.generate([[1, 2]], (SamplingParams(max_tokens=3, temperature=1, seed=5, stop="zz"),))
    assert len(out[0].token_ids) == 3
    assert snapshot(ckpt) == before


@pytest.mark.parametrize("flags,needle", [
    (["--temperature", "nan"], "temperature must be a finite number >= 0, got nan"),
    (["--top-p", "inf"], "top_p must be a finite number > 0 and <= 1, got inf"),
    (["--max-tokens", "0"], "max_tokens must be an integer >= 1, got 0"),
    (["--stop", ""], "stop strings must be non-empty"),
], ids=["temperature_nan", "top_p_inf", "max_tokens_zero", "stop_empty"])
def test_cli_bad_sampling_flag(ckpt, capsys, flags, needle):
    assert needle in main_error(capsys, "generate", "--model", ckpt, "--prompt", "x", *flags)


def test_cli_bad_sampling_flag_subprocess(ckpt):
    before = snapshot(ckpt)
    assert_one_line_error(run_cli("generate", "--model", ckpt, "--stop", ""), "stop strings must be non-empty")
    assert snapshot(ckpt) == before
