"""Oracle: transformers' own implementation of each family. Logits within 1e-4 (fp32)
for single and batched ragged inputs; greedy generations equal token for token."""
import pytest
import torch

from specmoe import LLM, SamplingParams
from tests.conftest import FAMILIES
from tests.hf_compare import hf_greedy

PROMPTS = [[5, 9, 3, 7, 2, 8, 11, 40], [4, 6, 10], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24], [30]]


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family, tiny_ckpt, hf_model):
    path = tiny_ckpt(family)
    hf, llm = hf_model(path), LLM(path, dtype="float32")
    ours = llm.logits(PROMPTS)  # batched, ragged
    assert ours.shape == (len(PROMPTS), max(map(len, PROMPTS)), llm.config.vocab_size)
    for b, ids in enumerate(PROMPTS):
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        assert (ours[b, :len(ids)] - ref).abs().max().item() <= 1e-4
        single = llm.logits([ids])[0]
        assert (single - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_generation_matches_transformers(family, tiny_ckpt, hf_model):
    path = tiny_ckpt(family)
    hf, llm = hf_model(path), LLM(path, dtype="float32")
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True))
    for ids, out in zip(PROMPTS, outs):
        ref = hf_greedy(hf, ids, 12)
        assert out.token_ids == ref


def test_sharded_checkpoint(tmp_path, hf_model):
    from tests.conftest import make_tiny_checkpoint
    path = make_tiny_checkpoint("qwen3_moe", tmp_path / "sharded", shard_size="20KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("model-*.safetensors"))) > 1
    hf, llm = hf_model(path), LLM(path, dtype="float32")
    with torch.no_grad():
        ref = hf(torch.tensor([PROMPTS[0]])).logits[0]
    assert (llm.logits([PROMPTS[0]])[0] - ref).abs().max().item() <= 1e-4


def test_bf16_checkpoint_and_dtype_override(tmp_path, monkeypatch):
    from specmoe.weights import autodtype
    from tests.conftest import make_tiny_checkpoint
    path = make_tiny_checkpoint("mixtral", tmp_path / "bf16", dtype=torch.bfloat16)
    for fast, want in ((True, torch.bfloat16), (False, torch.float32)):  # auto = the checkpoint's dtype where fast
        monkeypatch.setattr(autodtype, "half_matmul_is_fast", lambda dtype, fast=fast: fast)
        assert LLM(path).dtype == want
    llm32 = LLM(path, dtype="float32")
    assert llm32.dtype == torch.float32 and llm32.model.embed.weight.dtype == torch.float32
    from specmoe import kernels
    # experts stay in their stored bf16 where the native kernels compute from it (no fp32 copy), else fp32 copies
    assert llm32.store.layers[0].dtype == (torch.bfloat16 if kernels.available() else torch.float32)


def test_sliding_window_mixtral(tmp_path, hf_model):
    from tests.conftest import make_tiny_checkpoint
    path = make_tiny_checkpoint("mixtral", tmp_path / "sw", sliding_window=4)
    hf, llm = hf_model(path), LLM(path, dtype="float32")
    ids = PROMPTS[2]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (llm.logits([ids])[0] - ref).abs().max().item() <= 1e-4


@pytest.mark.parametrize("family", ["qwen3_moe", "olmoe"])
def test_attention_bias_checkpoint_matches_transformers(family, tiny_ckpt, hf_model):
    """attention_bias=true: transformers gives q, k, v and o projections a bias; the checkpoint loads and its
    logits match."""
    path = tiny_ckpt(family, attention_bias=True)
    hf, llm = hf_model(path), LLM(path, dtype="float32")
    assert llm.config.qkv_bias and llm.config.o_proj_bias
    ids = PROMPTS[0]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (llm.logits([ids])[0] - ref).abs().max().item() <= 1e-4
