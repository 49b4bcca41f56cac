"""LLM(...) options: wrong types, NaN/inf, out-of-range values, sizes like "1e999", devices that
do not exist, non-floating dtypes, max_batch 0, repack_dir "". Each is an InputError (a
SpecMoEError) naming the option; nothing is loaded or written."""
import math

import pytest
import torch

from specmoe import LLM
from specmoe.errors import InputError, SpecMoEError
from tests.validation.conftest import assert_one_line_error, main_error, run_cli, snapshot

NAN, INF = math.nan, math.inf

# (case id, LLM keyword arguments, text the message must contain)
OPTION_CASES = [
    ("max_batch_zero", dict(max_batch=0), "max_batch must be an integer >= 1, got 0"),
    ("max_batch_float", dict(max_batch=2.5), "max_batch must be an integer >= 1, got 2.5"),
    ("max_batch_bool", dict(max_batch=True), "max_batch must be an integer >= 1, got True"),
    ("max_batch_string", dict(max_batch="8"), "max_batch must be an integer >= 1, got '8'"),
    ("max_model_len_one", dict(max_model_len=1), "max_model_len must be an integer >= 2"),
    ("max_model_len_inf", dict(max_model_len=INF), "max_model_len must be an integer >= 2, got inf"),
    ("threads_zero", dict(threads=0), "threads must be an integer in [1, 4096], got 0"),
    ("threads_nan", dict(threads=NAN), "threads must be an integer in [1, 4096], got nan"),
    ("progress_string", dict(progress="yes"), "progress must be True or False"),
    ("model_empty", dict(model=""), "model must be a checkpoint directory path"),
    ("model_int", dict(model=3), "model must be a checkpoint directory path"),
    ("device_unknown", dict(device="gpu"), "device='gpu' is not a device name"),
    ("device_mps", dict(device="mps"), "device='mps' is not supported"),
    ("device_int", dict(device=1.5), "device must be a string"),
    ("device_cuda_99", dict(device="cuda:99"), "cuda:99"),
    ("dtype_int8_name", dict(dtype="int8"), "dtype='int8' is not supported"),
    ("dtype_torch_int", dict(dtype=torch.int32), "dtype=torch.int32 is not a supported compute dtype"),
    ("dtype_torch_complex", dict(dtype=torch.complex64), "is not a supported compute dtype"),
    ("dtype_number", dict(dtype=16), "dtype must be a string or a torch.dtype"),
    ("cache_bytes_1e999", dict(cache_bytes="1e999"), "cache_bytes: cannot read '1e999' as a finite byte size"),
    ("cache_bytes_inf_float", dict(cache_bytes=INF), "cache_bytes: byte size inf is not finite"),
    ("cache_bytes_nan_float", dict(cache_bytes=NAN), "cache_bytes: byte size nan is not finite"),
    ("cache_bytes_negative", dict(cache_bytes=-4096), "cache_bytes: byte size -4096 must be positive"),
    ("cache_bytes_zero_str", dict(cache_bytes="0GiB"), "must be positive"),
    ("cache_bytes_bool", dict(cache_bytes=True), "cache_bytes: a byte size must be an integer or a string"),
    ("memory_budget_list", dict(memory_budget=[1]), "memory_budget: a byte size must be an integer or a string"),
    ("memory_budget_garbage", dict(memory_budget="lots"), "memory_budget: cannot read 'lots'"),
    ("cache_experts_zero", dict(cache_experts=0), "cache_experts must be an integer >= 1, got 0"),
    ("cache_experts_float", dict(cache_experts=2.0), "cache_experts must be an integer >= 1, got 2.0"),
    ("link_gbps_nan", dict(offload="host", link_gbps=NAN), "link_gbps must be a finite number > 0, got nan"),
    ("link_gbps_inf", dict(offload="host", link_gbps=INF), "link_gbps must be a finite number > 0, got inf"),
    ("link_latency_negative", dict(offload="host", link_latency_us=-1.0), "link_latency_us must be a finite number >= 0"),
    ("offload_unknown", dict(offload="ssd"), "offload='ssd'; choose one of none, host, disk"),
    ("offload_not_string", dict(offload=["disk"]), "offload=['disk']; choose one of"),
    ("repack_dir_empty", dict(offload="disk", repack_dir=""), "repack_dir must be a directory path"),
    ("repack_dir_blank", dict(offload="disk", repack_dir="  "), "repack_dir must be a directory path"),
    ("repack_dir_int", dict(offload="disk", repack_dir=5), "repack_dir must be a directory path"),
    ("decoding_unknown", dict(decoding="beam"), "decoding='beam'; choose one of ar, specmoe, auto"),
    ("draft_experts_zero", dict(decoding="specmoe", draft_experts=0), "draft_experts must be an integer >= 1"),
    ("draft_experts_float", dict(decoding="specmoe", draft_experts=4.0), "draft_experts must be an integer >= 1"),
    ("gamma_huge", dict(decoding="specmoe", num_draft_tokens=10**9), "num_draft_tokens must be an integer in [1, 64]"),
    ("spec_seed_string", dict(seed="1"), "seed must be an integer"),
    ("unknown_option", dict(cache_sizes=3), "unknown option(s): cache_sizes"),
]


@pytest.mark.parametrize("kw,needle", [c[1:] for c in OPTION_CASES], ids=[c[0] for c in OPTION_CASES])
def test_bad_llm_option(ckpt, kw, needle):
    if kw.get("device") == "cuda:99" and not torch.cuda.is_available():
        needle = "CUDA is not available"
    before = snapshot(ckpt)
    kw = {"model": ckpt, **kw}
    with pytest.raises(InputError) as e:
        LLM(**kw)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert snapshot(ckpt) == before
    assert not (ckpt / ".specmoe").exists()  # nothing was repacked or cached


def test_good_options_still_accepted(ckpt):
    """Control: the forms the README documents keep working."""
    llm = LLM(ckpt, dtype=torch.float32, device=torch.device("cpu"), max_batch=2, max_model_len=64,
              offload="host", cache_bytes="256KiB", memory_budget=2.5e6, link_gbps=8, link_latency_us=0)
    assert llm.offload_cfg.cache_bytes == 256 * 1024 and llm.offload_cfg.memory_budget == 2_500_000
    assert llm.generate([[1, 2]])[0].token_ids


# (case id, CLI flags, text stderr must contain): usage errors and option errors alike are one line, exit 2
CLI_CASES = [
    ("cache_bytes_1e999", ["--cache-bytes", "1e999"], "argument --cache-bytes: invalid size value: '1e999'"),
    ("max_batch_zero", ["--max-batch", "0"], "max_batch must be an integer >= 1, got 0"),
    ("device_unknown", ["--device", "tpu"], "device='tpu'"),
    ("link_gbps_nan", ["--offload", "host", "--link-gbps", "nan"], "link_gbps must be a finite number > 0"),
    ("repack_dir_empty", ["--offload", "disk", "--repack-dir", ""], "repack_dir must be a directory path"),
    ("max_tokens_word", ["--max-tokens", "ten"], "argument --max-tokens: invalid int value: 'ten'"),
    ("gamma_huge", ["--decoding", "specmoe", "--num-draft-tokens", "100000"], "num_draft_tokens must be"),
]


@pytest.mark.parametrize("flags,needle", [c[1:] for c in CLI_CASES], ids=[c[0] for c in CLI_CASES])
def test_cli_bad_option(ckpt, capsys, flags, needle):
    before = snapshot(ckpt)
    err = main_error(capsys, "generate", "--model", ckpt, "--prompt", "x", *flags)
    assert needle in err, err
    assert snapshot(ckpt) == before


def test_cli_bad_option_subprocess(ckpt):
    before = snapshot(ckpt)
    assert_one_line_error(run_cli("generate", "--model", ckpt, "--cache-bytes", "1e999"), "1e999")
    assert_one_line_error(run_cli("generate", "--model", ckpt, "--offload", "disk", "--repack-dir", ""),
                          "specmoe: error: repack_dir")
    assert snapshot(ckpt) == before
    assert issubclass(InputError, SpecMoEError)
