"""Bad checkpoints give one clear line naming the problem (CheckpointError / UnsupportedModelError)."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specmoe import LLM
from specmoe.errors import CheckpointError, UnsupportedModelError
from tests.conftest import make_tiny_checkpoint


@pytest.fixture
def ckpt(tmp_path, tiny_ckpt):
    dst = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt("qwen3_moe"), dst)
    return dst


def test_missing_dir(tmp_path):
    with pytest.raises(CheckpointError, match="model directory not found"):
        LLM(tmp_path / "nope")


def test_missing_config(ckpt):
    (ckpt / "config.json").unlink()
    with pytest.raises(CheckpointError, match="missing config.json"):
        LLM(ckpt)


def test_unknown_model_type_lists_supported(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedModelError, match="unsupported model_type 'gpt2'.*mixtral.*qwen3_moe"):
        LLM(ckpt)


def test_missing_shard(tmp_path):
    path = make_tiny_checkpoint("mixtral", tmp_path / "sh", shard_size="20KB")
    victim = sorted(path.glob("model-*.safetensors"))[1]
    victim.unlink()
    with pytest.raises(CheckpointError, match=f"missing shard {victim.name}"):
        LLM(path)


def test_truncated_safetensors(ckpt):
    f = ckpt / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[: len(data) - 1000])
    with pytest.raises(CheckpointError, match="truncated"):
        LLM(ckpt)


def test_garbage_safetensors(ckpt):
    (ckpt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(CheckpointError, match="corrupt"):
        LLM(ckpt)


def test_wrong_shape(ckpt):
    f = ckpt / "model.safetensors"
    sd = load_file(f)
    key = "model.layers.0.mlp.experts.3.up_proj.weight"
    sd[key] = torch.zeros(sd[key].shape[0] + 1, sd[key].shape[1])
    save_file(sd, f)
    with pytest.raises(CheckpointError, match=f"tensor {key} has shape"):
        LLM(ckpt)


def test_missing_and_unexpected_keys(ckpt):
    f = ckpt / "model.safetensors"
    sd = load_file(f)
    sd.pop("model.layers.1.self_attn.q_norm.weight")
    save_file(sd, f)
    with pytest.raises(CheckpointError, match="missing 1 tensor.*model.layers.1.self_attn.q_norm.weight"):
        LLM(ckpt)
    sd["model.layers.1.self_attn.q_norm.weight"] = torch.ones(16)
    sd["model.layers.0.mystery.weight"] = torch.ones(3)
    save_file(sd, f)
    with pytest.raises(CheckpointError, match="unexpected tensor.*model.layers.0.mystery.weight"):
        LLM(ckpt)


def test_pickle_only_refused(ckpt):
    sd = load_file(ckpt / "model.safetensors")
    (ckpt / "model.safetensors").unlink()
    torch.save(sd, ckpt / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pickle.*safetensors only"):
        LLM(ckpt)


def test_rope_theta_top_level_accepted(ckpt, tiny_ckpt):
    """Older configs carry rope_theta at top level instead of rope_parameters."""
    cfg = json.loads((ckpt / "config.json").read_text())
    theta = cfg.pop("rope_parameters")["rope_theta"]
    cfg["rope_theta"] = theta
    (ckpt / "config.json").write_text(json.dumps(cfg))
    a = LLM(ckpt, dtype="float32").logits([[1, 2, 3]])
    b = LLM(tiny_ckpt("qwen3_moe"), dtype="float32").logits([[1, 2, 3]])
    assert torch.equal(a, b)
