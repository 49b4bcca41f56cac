"""Checkpoints that ship quantized weights, read end to end as stored: GPT-OSS with MXFP4 experts and DeepSeek-V3
with block-scaled FP8 (tests/formats/native.py builds them with the published key names and dtypes).

Oracle: transformers' own loading path for these checkpoints with dequantize=True (Mxfp4Config /
FineGrainedFP8Config; on a CPU it dequantises to the requested dtype): logits within 1e-4 in fp32 (batched
ragged and single), greedy equal. The experts stay in their stored format in the host tier and the disk repack,
move in their stored bytes (bytes_moved == fetches x stored bytes per expert) and are dequantised on arrival, so
offloaded == resident bit for bit and SpecMoE greedy == AR greedy."""
from __future__ import annotations

import json

import pytest
import torch

from specmoe import LLM, SamplingParams
from specmoe.experts.formats import Native, make_format
from tests.formats.native import hf_dequantized, make_fp8_checkpoint, make_mxfp4_checkpoint
from tests.models.test_families import max_logit_diff
from tests.hf_compare import hf_greedy

PROMPTS = [[5, 9, 3, 7, 2, 8, 11, 40], [4, 6, 10], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24], [30]]
GREEDY = SamplingParams(max_tokens=10, ignore_eos=True)
FORMAT = {"mxfp4": "mxfp4", "fp8": "fp8-block"}


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    """native("mxfp4" | "fp8") -> checkpoint path, built once per module."""
    made = {}

    def get(method: str):
        if method not in made:
            d = tmp_path_factory.mktemp(f"native_{method}")
            made[method] = (make_mxfp4_checkpoint if method == "mxfp4" else make_fp8_checkpoint)(d)
        return made[method]
    return get


def stored_bytes_from_shapes(path) -> int:
    """One expert's stored bytes, from the checkpoint's own tensors (each stored tensor 16-byte aligned)."""
    from safetensors import safe_open
    cfg = json.loads((path / "config.json").read_text())
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        if cfg["quantization_config"]["quant_method"] == "mxfp4":
            base = "model.layers.0.mlp.experts."
            names = ["gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales",
                     "gate_up_proj_bias", "down_proj_bias"]
            sizes = [f.get_tensor(base + n)[0].numel() * f.get_tensor(base + n).element_size() for n in names]
        else:
            base = "model.layers.1.mlp.experts.0."
            sizes = []
            for p in ("gate_proj", "up_proj", "down_proj"):
                w, s = f.get_tensor(base + p + ".weight"), f.get_tensor(base + p + ".weight_scale_inv")
                assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
                sizes += [w.numel(), s.numel() * 4]
    return sum(-(-n // 16) * 16 for n in sizes)


@pytest.mark.parametrize("method", ["mxfp4", "fp8"])
def test_logits_and_greedy_match_transformers_dequantized(method, native):
    path = native(method)
    hf, llm = hf_dequantized(path), LLM(path, dtype="float32")
    assert llm.config.quantization.method == method
    # the oracle dequantised the stored weights (not random init): its experts equal ours, value for value
    ours = llm.ckpt.read_expert(llm.config.moe_layers[0], 2, torch.float32)
    mlp = hf.model.layers[llm.config.moe_layers[0]].mlp.experts
    I, D = llm.config.expert_intermediate_size, llm.config.hidden_size
    if method == "mxfp4":  # transformers' [E, D, 2I], gate/up interleaved column by column
        gate = mlp.gate_up_proj[2, :, 0::2].T
    else:  # [E, 2I, D], gate rows first
        gate = mlp.gate_up_proj[2, :I]
    assert torch.equal(ours[: I * D].view(I, D), gate) and gate.abs().max() > 0
    assert max_logit_diff(llm, hf, PROMPTS) <= 1e-4
    for ids, out in zip(PROMPTS, llm.generate(PROMPTS, GREEDY)):
        ref = hf_greedy(hf, ids, 10)
        assert out.token_ids == ref


def test_fp8_non_expert_weights_are_dequantized_at_load(native):
    """Attention, the dense first layer's MLP and the shared experts are float8 in the file; the model holds them
    dequantised in the compute dtype, equal to transformers' dequantised parameters."""
    from safetensors import safe_open
    path = native("fp8")
    hf, llm = hf_dequantized(path), LLM(path, dtype="float32")
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        assert f.get_slice("model.layers.0.self_attn.q_a_proj.weight").get_dtype() == "F8_E4M3"
        assert f.get_slice("model.layers.0.mlp.gate_proj.weight").get_dtype() == "F8_E4M3"
    hsd = hf.state_dict()
    for ours, theirs in (("layers.0.attn.q_a_proj.weight", "model.layers.0.self_attn.q_a_proj.weight"),
                         ("layers.0.mlp.down_proj.weight", "model.layers.0.mlp.down_proj.weight"),
                         ("layers.1.mlp.shared.up_proj.weight", "model.layers.1.mlp.shared_experts.up_proj.weight"),
                         ("layers.2.attn.kv_b_proj.weight", "model.layers.2.self_attn.kv_b_proj.weight")):
        p = llm.model.get_parameter(ours)
        assert p.dtype == torch.float32 and torch.equal(p, hsd[theirs])
    assert LLM(path, dtype="bfloat16").model.get_parameter("layers.0.attn.q_a_proj.weight").dtype == torch.bfloat16


@pytest.mark.parametrize("method", ["mxfp4", "fp8"])
def test_offloaded_moves_stored_bytes_and_equals_resident(method, native, tmp_path):
    path = native(method)
    res = LLM(path, dtype="float32")
    ref_logits, ref_tokens = res.logits(PROMPTS), [o.token_ids for o in res.generate(PROMPTS, GREEDY)]
    stored = stored_bytes_from_shapes(path)
    cfg = res.config
    assert stored < cfg.expert_numel * 2 * (0.3 if method == "mxfp4" else 0.55)  # vs the bf16 expert
    for tier in ("host", "disk"):
        llm = LLM(path, dtype="float32", offload=tier, cache_experts=3, repack_dir=tmp_path)
        assert torch.equal(llm.logits(PROMPTS), ref_logits)
        assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == ref_tokens
        s = llm.stats
        assert s["expert_format"] == FORMAT[method] and s["bytes_per_expert"] == stored
        assert s["compute_bytes_per_expert"] == cfg.expert_numel * 4
        assert s["fetches"] > 0 and s["misses"] > 0 and s["bytes_moved"] == s["fetches"] * stored
        if tier == "host":  # the host copy holds the stored bytes
            assert llm.expert_memory.parts["host_tier"] == cfg.num_experts * len(cfg.moe_layers) * stored
        else:  # so does the repack file, under the format's name
            (f,) = tmp_path.glob(f"experts-{FORMAT[method]}-*.bin")
            assert f.stat().st_size == cfg.num_experts * len(cfg.moe_layers) * (-(-stored // 4096) * 4096)
            assert s["io_reads"] == s["fetches"]
    # expert_format names the stored format explicitly too; another checkpoint's format is a clear error
    assert LLM(path, expert_format=FORMAT[method], offload="host", cache_experts=3).stats["expert_format"] \
        == FORMAT[method]


@pytest.mark.parametrize("method", ["mxfp4", "fp8"])
def test_bf16_compute_offloaded_equals_resident(method, native, tmp_path):
    path = native(method)
    res = LLM(path, dtype="bfloat16")
    llm = LLM(path, dtype="bfloat16", offload="disk", cache_experts=3, repack_dir=tmp_path)
    assert torch.equal(llm.logits(PROMPTS), res.logits(PROMPTS))
    assert llm.stats["fetches"] > 0


@pytest.mark.parametrize("method", ["mxfp4", "fp8"])
def test_specmoe_greedy_equals_ar_on_the_stored_format(method, native, tmp_path):
    path = native(method)
    ps = PROMPTS + [[7, 1, 2]]
    ref = [o.token_ids for o in LLM(path, dtype="float32").generate(ps, GREEDY)]
    llm = LLM(path, dtype="float32", offload="disk", cache_experts=4, repack_dir=tmp_path, decoding="specmoe",
              draft_experts=3, num_draft_tokens=3)
    assert [o.token_ids for o in llm.generate(ps, GREEDY)] == ref
    s = llm.stats
    assert s["expert_format"] == FORMAT[method] and s["draft_phase_bytes"] == 0
    assert s["drafted_tokens"] > 0 and s["accepted_tokens"] < s["drafted_tokens"]  # drafts made, some rejected
    assert s["bytes_moved"] == s["fetches"] * s["bytes_per_expert"]


@pytest.mark.parametrize("method", ["mxfp4", "fp8"])
def test_inspect_shows_the_stored_format(method, native, capsys):
    from specmoe.cli import main
    from specmoe.experts.formats import ExpertShape
    path = native(method)
    assert main(["inspect", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    stored = stored_bytes_from_shapes(path)
    own = info["expert_formats"][0]
    assert info["quantization"] == method and own["expert_format"] == "checkpoint"
    assert own["storage"] == FORMAT[method] and own["bytes_per_expert"] == stored
    cfg = LLM(path).config
    assert own["bytes_per_token_cold"] == stored * cfg.top_k * len(cfg.moe_layers)
    assert own["ratio"] == round(stored / (cfg.expert_numel * 2), 4)  # against the bf16 (dequantised) expert
    assert make_format("checkpoint", ExpertShape.of(cfg), torch.bfloat16).stored_bytes == stored
    assert isinstance(make_format(FORMAT[method], ExpertShape.of(cfg), torch.bfloat16), Native)
    assert main(["inspect", str(path)]) == 0
    assert f"checkpoint ({FORMAT[method]})" in capsys.readouterr().out


def test_int8_from_a_native_checkpoint(native, tmp_path):
    """int8 experts quantised from the dequantised MXFP4 weights: a third model, offloaded == resident."""
    path = native("mxfp4")
    res = LLM(path, dtype="float32", expert_format="int8", repack_dir=tmp_path)
    llm = LLM(path, dtype="float32", expert_format="int8", offload="host", cache_experts=3, repack_dir=tmp_path)
    assert torch.equal(llm.logits(PROMPTS), res.logits(PROMPTS)) and llm.stats["expert_format"] == "int8"


def test_fp8_is_read_for_other_families(tmp_path):
    """Fine-grained FP8 is not DeepSeek's alone (Qwen3-MoE and GLM-4.5 ship FP8 releases in the same format):
    a Qwen3-MoE checkpoint with FP8 experts and attention matches transformers' dequantised model, offloaded ==
    resident."""
    path = make_fp8_checkpoint(tmp_path / "q", family="qwen3_moe")
    hf, llm = hf_dequantized(path), LLM(path, dtype="float32")
    assert max_logit_diff(llm, hf, PROMPTS[:2]) <= 1e-4
    off = LLM(path, dtype="float32", offload="host", cache_experts=3)
    assert torch.equal(off.logits(PROMPTS), llm.logits(PROMPTS))
    s = off.stats
    assert s["expert_format"] == "fp8-block" and s["bytes_moved"] == s["fetches"] * s["bytes_per_expert"] > 0
