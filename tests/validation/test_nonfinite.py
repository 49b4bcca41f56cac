"""A checkpoint whose weights overflow gives inf/NaN logits: generate (every strategy, greedy or
sampled) and logits() raise NonFiniteLogitsError naming the problem; nothing is sampled."""
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specmoe import LLM, SamplingParams
from specmoe.errors import NonFiniteLogitsError, SpecMoEError
from tests.validation.conftest import NO_REPACK, assert_one_line_error, run_cli, snapshot


def scale(ckpt, key, factor):
    f = ckpt / "model.safetensors"
    sd = load_file(f)
    sd[key] = sd[key] * factor
    save_file(sd, f, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def huge(tmp_path_factory, tiny_ckpt):
    """The final norm scaled by 1e38 and the LM head by 1e4: the logits overflow fp32 to ±inf/NaN."""
    d = tmp_path_factory.mktemp("huge") / "ckpt"
    shutil.copytree(tiny_ckpt("qwen3_moe"), d, ignore=NO_REPACK)
    scale(d, "model.norm.weight", 1e38)
    scale(d, "lm_head.weight", 1e4)
    return d


@pytest.mark.parametrize("opts,params", [
    ({}, SamplingParams(max_tokens=4)),
    ({}, SamplingParams(max_tokens=4, temperature=0.8, top_p=0.9, seed=1)),
    ({"decoding": "specmoe", "draft_experts": 2}, SamplingParams(max_tokens=4)),
    ({"offload": "host", "cache_experts": 2}, SamplingParams(max_tokens=4)),
], ids=["ar_greedy", "ar_sampled", "specmoe", "host_offload"])
def test_generate_refuses_nonfinite_logits(huge, opts, params):
    before = snapshot(huge)
    llm = LLM(huge, dtype="float32", max_batch=4, **opts)
    with pytest.raises(NonFiniteLogitsError) as e:
        llm.generate([[1, 2, 3], [4, 5]], params)
    msg = str(e.value)
    assert "non-finite logits (inf/NaN) for 2 of 2 sequence(s)" in msg and "nothing was sampled" in msg, msg
    assert isinstance(e.value, SpecMoEError)
    assert snapshot(huge) == before


def test_logits_refuses_nonfinite(huge):
    llm = LLM(huge, dtype="float32", max_batch=2)
    with pytest.raises(NonFiniteLogitsError, match=r"for 3 of 3 prompt\(s\)"):
        llm.logits([[1, 2], [3], [4, 5, 6]])


def test_one_bad_row_is_named(tmp_path, tiny_ckpt):
    """Only the rows whose logits overflow are reported: a huge embedding row for token 7."""
    d = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt("qwen3_moe"), d, ignore=NO_REPACK)
    f = d / "model.safetensors"
    sd = load_file(f)
    sd["model.embed_tokens.weight"][7] = float("nan")
    save_file(sd, f, metadata={"format": "pt"})
    llm = LLM(d, dtype="float32", max_batch=4)
    with pytest.raises(NonFiniteLogitsError, match=r"for 1 of 3 sequence\(s\) \(rows \[1\]\)"):
        llm.generate([[1, 2], [3, 7], [4]], SamplingParams(max_tokens=3))
    assert llm.generate([[1, 2]], SamplingParams(max_tokens=3, ignore_eos=True))[0].token_ids  # engine still usable


def test_cli_nonfinite_is_one_line(huge):
    before = snapshot(huge)
    jl = huge.parent / "ids.jsonl"  # the tiny checkpoint has no tokenizer: token-id prompts
    jl.write_text('{"prompt": [1, 2, 3]}\n')
    assert_one_line_error(run_cli("generate", "--model", huge, "--prompts-file", jl, "--json"), "non-finite logits")
    assert snapshot(huge) == before


def test_healthy_logits_are_accepted(tiny_ckpt):
    """Control: the check does not fire on a normal checkpoint (and -inf never comes from a model)."""
    llm = LLM(tiny_ckpt("qwen3_moe"), dtype="float32", max_batch=2)
    assert torch.isfinite(llm.logits([[1, 2, 3]])).all()
    assert len(llm.generate([[1, 2, 3]], SamplingParams(max_tokens=5, ignore_eos=True))[0].token_ids) == 5


@pytest.mark.parametrize("value,finite", [(float("nan"), False), (float("inf"), False), (float("-inf"), False),
                                          (3.0e38, True), (-3.0e38, True), (0.0, True)],
                         ids=["nan", "pos_inf", "neg_inf", "huge_finite", "huge_negative_finite", "zero"])
def test_finite_rows_is_exact(value, finite):
    """The cheap row check (amax/amin) flags exactly the rows holding an inf or NaN anywhere."""
    from specmoe.decoding.runtime.sampling import finite_rows
    x = torch.randn(3, 4, 1000)
    x[1, 2, 517] = value
    expected = torch.ones(3, 4, dtype=torch.bool)
    expected[1, 2] = finite
    assert torch.equal(finite_rows(x), expected)
