"""Storage format vs compute dtype, end to end: a bf16 checkpoint computed in fp32 keeps bf16 experts in its
tiers and moves bf16 bytes; int8 / int4 experts move their stored bytes and decode on arrival, so offloaded
== resident bit for bit and speculative greedy == AR greedy on the quantized model."""
from __future__ import annotations

import pytest
import torch

from specmoe import kernels
from specmoe import LLM, SamplingParams
from specmoe.weights.checkpoint import Checkpoint

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16]]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def bf16_ckpt(tmp_path_factory):
    from tests.conftest import make_tiny_checkpoint
    # hidden and expert width whole groups of 64: int8 and int4 (g32 / g64) slots keep their stored bytes natively
    p = make_tiny_checkpoint("qwen3_moe", tmp_path_factory.mktemp("bf16"), dtype=torch.bfloat16, hidden_size=64,
                             moe_intermediate_size=64)
    assert Checkpoint(p).storage_dtype == torch.bfloat16
    return p


def run(llm):
    return llm.logits(PROMPTS), [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("tier", [dict(offload="host"), dict(offload="disk"),
                                  dict(offload="host", link_gbps=5.0, link_latency_us=5.0)])
def test_bf16_checkpoint_in_fp32_moves_bf16_bytes(bf16_ckpt, tmp_path, tier):
    ref = LLM(bf16_ckpt, dtype="float32")
    ref_logits, ref_tokens = run(ref)
    llm = LLM(bf16_ckpt, dtype="float32", cache_experts=2, repack_dir=tmp_path, **tier)
    logits, tokens = run(llm)
    assert torch.equal(logits, ref_logits) and tokens == ref_tokens  # offloaded == resident, in fp32
    s = llm.stats
    cfg = llm.config
    assert llm.dtype == torch.float32 and s["expert_format"] == "bfloat16"
    # slots keep the stored bf16 where the native kernels compute from it (no fp32 copy), else fp32 copies
    slot = 2 if kernels.available() else 4
    assert s["bytes_per_expert"] == cfg.expert_numel * 2 and s["compute_bytes_per_expert"] == cfg.expert_numel * slot
    assert s["fetches"] > 0 and s["bytes_moved"] == s["fetches"] * cfg.expert_numel * 2
    if tier["offload"] == "host":  # the host copy is bf16 too
        assert llm.expert_memory.parts["host_tier"] == cfg.num_experts * len(cfg.moe_layers) * cfg.expert_numel * 2
    else:  # the repack file holds bf16 experts
        assert list(tmp_path.glob("experts-bfloat16-*.bin")) and not list(tmp_path.glob("experts-float32-*"))
        assert s["io_reads"] == s["fetches"]


@pytest.mark.parametrize("path", ["native", "torch"])
@pytest.mark.parametrize("fmt", ["int8", "int4", "int4-g64"])
def test_quantized_offloaded_equals_resident_and_specmoe_equals_ar(bf16_ckpt, tmp_path, fmt, path, request):
    """On the native kernels the slots hold the quantized bytes as stored (nothing decoded on arrival: a slot is
    the stored size); on the torch path they are decoded to fp32 on arrival."""
    if path == "torch":
        request.getfixturevalue("torch_path")
    elif not kernels.available():
        pytest.skip("native kernels unavailable")
    res = LLM(bf16_ckpt, dtype="float32", expert_format=fmt, repack_dir=tmp_path)
    ref_logits, ref_tokens = run(res)
    plain_logits, _ = run(LLM(bf16_ckpt, dtype="float32"))
    assert not torch.equal(ref_logits, plain_logits)  # the quantized model is another model, close to the bf16 one
    assert (ref_logits - plain_logits).abs().mean() < 0.5 * plain_logits.abs().mean()  # int4: ~0.3
    for tier in ("host", "disk"):
        llm = LLM(bf16_ckpt, dtype="float32", expert_format=fmt, offload=tier, cache_experts=3, repack_dir=tmp_path)
        logits, tokens = run(llm)
        assert torch.equal(logits, ref_logits) and tokens == ref_tokens
        s = llm.stats
        assert s["expert_format"] == ("int4-g32" if fmt == "int4" else fmt)
        assert s["fetches"] > 0 and s["bytes_moved"] == s["fetches"] * s["bytes_per_expert"]
        assert s["bytes_per_expert"] < llm.config.expert_numel * 2 * (0.6 if fmt == "int8" else 0.35)
        slot = s["bytes_per_expert"] if path == "native" else llm.config.expert_numel * 4
        assert s["compute_bytes_per_expert"] == slot
    spec = LLM(bf16_ckpt, dtype="float32", expert_format=fmt, offload="disk", cache_experts=4, repack_dir=tmp_path,
               decoding="specmoe", draft_experts=3, num_draft_tokens=3)
    assert [o.token_ids for o in spec.generate(PROMPTS, GREEDY)] == ref_tokens
    s = spec.stats
    assert s["drafted_tokens"] > 0 and s["accepted_tokens"] < s["drafted_tokens"]  # drafts made, some rejected


@pytest.mark.parametrize("fmt", ["int8", "int4", "int4-g64"])
def test_quantized_native_kernels_equal_the_decoded_torch_path(bf16_ckpt, tmp_path, fmt):
    """The native kernels computing from the stored int8 / int4 bytes give the logits and greedy tokens of the torch
    path that decodes them to fp32 first (to fp32 rounding: the two sum in another order)."""
    if not kernels.available():
        pytest.skip("native kernels unavailable")
    kw = dict(dtype="float32", expert_format=fmt, offload="host", cache_experts=3, repack_dir=tmp_path)
    native = LLM(bf16_ckpt, **kw)
    n_logits, n_tokens = run(native)
    assert native.stats["compute_bytes_per_expert"] == native.stats["bytes_per_expert"]  # stored bytes in the slots
    kernels.set_enabled(False)
    try:
        decoded = LLM(bf16_ckpt, **kw)
        d_logits, d_tokens = run(decoded)
    finally:
        kernels.set_enabled(True)
    assert decoded.stats["compute_bytes_per_expert"] == decoded.config.expert_numel * 4  # fp32 copies
    torch.testing.assert_close(n_logits, d_logits, rtol=1e-4, atol=1e-4)
    assert n_tokens == d_tokens


def test_formats_use_separate_repack_files(bf16_ckpt, tmp_path):
    for fmt in ("checkpoint", "int8", "int4"):
        LLM(bf16_ckpt, offload="disk", expert_format=fmt, repack_dir=tmp_path, cache_experts=2)
    names = sorted(p.name.split("-")[1] for p in tmp_path.glob("experts-*.bin"))
    assert names == ["bfloat16", "int4", "int8"]


def test_disk_reads_direct_and_staged_give_the_same_expert_and_catch_corruption(tiny_ckpt, tmp_path):
    """CPU slots are filled through the tier's staging row (reads straight into slots slowed compute);
    `direct=True` (CUDA staging buffers) reads straight into the destination. Both verify the checksum."""
    from specmoe.errors import IntegrityError
    from specmoe.memory import aligned_empty
    from specmoe.experts.repack import open_repack
    from specmoe.experts.tiers import DiskTier
    ck = Checkpoint(tiny_ckpt("mixtral"))
    rp = open_repack(ck, torch.float32, tmp_path)
    direct, staged = DiskTier(rp, direct=True), DiskTier(rp)
    assert direct.direct and not staged.direct and direct.stride == rp.stride
    want = ck.read_expert(1, 3, torch.float32)
    for tier in (direct, staged):
        buf = aligned_empty(tier.stride)
        tier.read_into(1, 3, buf)
        assert torch.equal(buf[: tier.expert_bytes].view(torch.float32), want)
    with open(rp.file, "r+b") as f:  # flip one byte of layer 1 expert 3
        f.seek(rp.offset(1, 3) + 100)
        b = f.read(1)
        f.seek(rp.offset(1, 3) + 100)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(IntegrityError, match="layer 1 expert 3"):
        staged.read_into(1, 3, aligned_empty(staged.stride))
    for tier in (direct, staged):  # deferred: `verify` checks (and decodes) later, on the caller's thread
        buf = aligned_empty(tier.stride)
        tier.read_into(1, 3, buf, verify=False)
        with pytest.raises(IntegrityError, match="layer 1 expert 3"):
            tier.verify(1, 3, buf)
    # deferred staged reads: decoded only by `verify`, two at a time, the third finished on the I/O thread
    bufs = [aligned_empty(staged.stride) for _ in range(3)]
    for i, b in enumerate(bufs):
        b.zero_()
        staged.read_into(0, i, b, verify=False)
    assert len(staged._pending) == 2 and not bufs[0].any() and not bufs[1].any()
    assert torch.equal(bufs[2][: staged.expert_bytes].view(torch.float32), ck.read_expert(0, 2, torch.float32))
    for i, b in enumerate(bufs):
        staged.verify(0, i, b)
        assert torch.equal(b[: staged.expert_bytes].view(torch.float32), ck.read_expert(0, i, torch.float32))
    assert not staged._pending and len(staged._free) == 2


def test_quantized_gpt_oss_experts_with_biases(tiny_ckpt, tmp_path):
    """A family whose experts carry biases (packed after the weights): int8 offloaded == int8 resident."""
    ck = tiny_ckpt("gpt_oss")
    res = LLM(ck, expert_format="int8", repack_dir=tmp_path)
    ref = run(res)
    llm = LLM(ck, expert_format="int8", offload="disk", cache_experts=3, repack_dir=tmp_path)
    logits, tokens = run(llm)
    assert torch.equal(logits, ref[0]) and tokens == ref[1] and llm.stats["fetches"] > 0
