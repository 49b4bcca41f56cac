"""dtype="auto": fp32 compute on CPUs whose half matmul is slower, decided once per machine by a measured
micro-benchmark and cached; the checkpoint's dtype on CUDA and for fp32 checkpoints."""
from __future__ import annotations

import json

import pytest
import torch

from specmoe import LLM, machine_cache
from specmoe.weights import autodtype
from specmoe.weights.checkpoint import resolve_dtype


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECMOE_CACHE_DIR", str(tmp_path))
    return tmp_path


def fake_measure(monkeypatch, half_s: float):
    calls = []

    def measure(dtype):
        calls.append(dtype)
        return {"float32_s": 1.0, "half_s": half_s}
    monkeypatch.setattr(autodtype, "measure", measure)
    return calls


def test_measured_once_then_cached(cache_dir, monkeypatch):
    calls = fake_measure(monkeypatch, half_s=3.0)  # bf16 matmul 3x slower than fp32
    assert resolve_dtype("auto", "bfloat16", device="cpu") == torch.float32
    assert resolve_dtype("auto", "bfloat16", device="cpu") == torch.float32
    assert calls == [torch.bfloat16]  # measured once, then read from the cache
    data = json.loads((cache_dir / "machine.json").read_text())
    (key, entry), = data.items()
    assert machine_cache.cpu_model() in key and torch.__version__ in key and "bfloat16" in key
    assert entry["fast"] is False and entry["half_s"] == 3.0
    # the cached decision is what counts: flip it on disk and auto follows without measuring
    entry["fast"] = True
    (cache_dir / "machine.json").write_text(json.dumps(data))
    assert resolve_dtype("auto", "bfloat16", device="cpu") == torch.bfloat16
    assert calls == [torch.bfloat16]


def test_checkpoint_dtype_on_cuda_and_for_fp32(cache_dir, monkeypatch):
    calls = fake_measure(monkeypatch, half_s=3.0)
    assert resolve_dtype("auto", "bfloat16", device=torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("auto", "float32", device="cpu") == torch.float32
    assert resolve_dtype("bfloat16", "float32", device="cpu") == torch.bfloat16  # explicit wins
    assert calls == []


def test_real_micro_benchmark_runs(cache_dir):
    t = autodtype.measure(torch.bfloat16)
    assert t["float32_s"] > 0 and t["half_s"] > 0
    fast = autodtype.half_matmul_is_fast(torch.bfloat16)
    assert json.loads((cache_dir / "machine.json").read_text())[autodtype.machine_key(torch.bfloat16)]["fast"] is fast


def test_auto_on_slow_cpu_computes_fp32_from_bf16_storage(cache_dir, monkeypatch, tmp_path):
    from tests.conftest import make_tiny_checkpoint
    fake_measure(monkeypatch, half_s=3.0)
    p = make_tiny_checkpoint("mixtral", tmp_path / "m", dtype=torch.bfloat16)
    llm = LLM(p, offload="host", cache_experts=2)
    assert llm.dtype == torch.float32
    llm.generate([[1, 2, 3]])
    s = llm.stats
    assert s["expert_format"] == "bfloat16" and s["bytes_moved"] == s["fetches"] * llm.config.expert_numel * 2
