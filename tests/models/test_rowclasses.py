"""A `deterministic` model pads fp32 matmuls to the row count this machine's BLAS needs (measured, cached), not to a
count that held on another CPU (4 rows sufficed on an AMD EPYC; an Intel Xeon with AVX-512 needs up to 16)."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from specmoe import LLM, SamplingParams, machine_cache
from specmoe.models import rowclasses
from specmoe.models.layers import linear


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECMOE_CACHE_DIR", str(tmp_path))
    rowclasses._rows.cache_clear()
    yield tmp_path
    rowclasses._rows.cache_clear()


def test_probe_finds_the_count_from_which_rows_are_alike(torch_path):
    """The torch path's padding (on the native kernels a deterministic model is not padded: `native_invariant`)."""
    r = rowclasses.probe(contractions=(64, 512, 2048))
    R = r["rows"]
    assert 1 <= R < rowclasses.PROBE_ROWS
    g = torch.Generator().manual_seed(1)
    for K in (64, 512, 2048):  # fresh data: from R rows on a row's bits do not depend on the rows beside it
        w, x = torch.randn(48, K, generator=g), torch.randn(40, K, generator=g)
        ref = F.linear(x, w)
        assert all(torch.equal(F.linear(x[:m], w), ref[:m]) for m in range(R, 40))
        # and `linear` padded to R rows gives a single row those same bits
        assert torch.equal(linear(x[:1], w, rows=R), ref[:1])
    assert R == max(v for per in r["by_op"].values() for v in per.values())  # the least count for every op


def test_measured_once_cached_and_used_by_a_deterministic_model(fresh, monkeypatch):
    calls = []

    def probe():
        calls.append(1)
        return {"rows": 7, "by_op": {}}
    monkeypatch.setattr(rowclasses, "probe", probe)
    llm = LLM(dtype="float32", deterministic=True)
    assert llm.model.rows == 7 and all(layer.mlp.rows == 7 for layer in llm.model.layers)
    assert LLM(dtype="float32").model.rows == 1  # off: no padding
    assert calls == [1]
    data = json.loads((fresh / "machine.json").read_text())
    entry = data[machine_cache.machine_key("fp32 matmul row classes")]
    assert entry["rows"] == 7
    rowclasses._rows.cache_clear()  # a new process reads the cache without probing
    assert rowclasses.deterministic_rows() == 7 and calls == [1]


def test_fp32_attention_with_sinks_measures_the_row_classes_at_load_not_in_a_forward(fresh, monkeypatch, tiny_ckpt):
    """GPT-OSS's sinks take the fixed-split attention, which pads query rows to the row classes: the ~2 s probe
    runs when the model loads (then is cached), so no request's first forward pays it."""
    from specmoe.models import attention
    calls = []

    def probe():
        calls.append(1)
        return {"rows": 5, "by_op": {}}
    monkeypatch.setattr(rowclasses, "probe", probe)
    llm = LLM(tiny_ckpt("gpt_oss"), dtype="float32")
    assert calls == [1] and llm.config.attention_sinks
    assert attention.min_rows(torch.float32, 64) >= 5
    llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2))
    assert calls == [1]
    rowclasses._rows.cache_clear()
    LLM(tiny_ckpt("gpt_oss"), dtype="bfloat16")  # not fp32: nothing to measure
    assert calls == [1]
