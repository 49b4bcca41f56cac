"""The sharded index and the tensors it names: wrong JSON shape or types, non-UTF-8, a shard map
naming the wrong file or a path outside the checkpoint, non-floating tensor dtypes. Each is a
CheckpointError naming the file and what was expected; no file changes."""
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from specmoe import LLM
from specmoe.errors import CheckpointError
from tests.conftest import make_tiny_checkpoint
from tests.validation.conftest import assert_one_line_error, run_cli, snapshot

INDEX = "model.safetensors.index.json"


@pytest.fixture(scope="module")
def sharded_src(tmp_path_factory):
    return make_tiny_checkpoint("mixtral", tmp_path_factory.mktemp("sharded"), shard_size="20KB")


@pytest.fixture
def sharded(sharded_src, tmp_path):
    dst = tmp_path / "sharded"
    shutil.copytree(sharded_src, dst)
    return dst


def edit_map(fn):
    def edit(d):
        idx = json.loads((d / INDEX).read_text())
        fn(idx["weight_map"], d)
        (d / INDEX).write_text(json.dumps(idx))
    return edit


def wrong_file(wm, d):  # an existing shard that does not hold the tensor
    key = "model.layers.0.block_sparse_moe.experts.0.w1.weight"
    wm[key] = next(f for f in sorted(set(wm.values())) if f != wm[key])


def raw(data: bytes):
    return lambda d: (d / INDEX).write_bytes(data)


INDEX_CASES = [
    ("list", raw(b"[]"), "must hold a JSON object, got a list"),
    ("null", raw(b"null"), "must hold a JSON object, got null"),
    ("non_utf8", raw(b'{"weight_map": {"a": "\xff"}}'), "not UTF-8"),
    ("bad_json", raw(b'{"weight_map": '), "not valid JSON"),
    ("no_weight_map", raw(b'{"metadata": {}}'), "weight_map must be a non-empty object"),
    ("weight_map_list", raw(b'{"weight_map": ["model-00001-of-00002.safetensors"]}'),
     "weight_map must be a non-empty object"),
    ("shard_not_string", edit_map(lambda wm, d: wm.update({"lm_head.weight": 7})),
     "weight_map['lm_head.weight'] must be a .safetensors file name"),
    ("shard_outside_dir", edit_map(lambda wm, d: wm.update({"lm_head.weight": "../elsewhere.safetensors"})),
     "must be a .safetensors file name in"),
    ("shard_not_safetensors", edit_map(lambda wm, d: wm.update({"lm_head.weight": "config.json"})),
     "must be a .safetensors file name"),
    ("shard_missing", edit_map(lambda wm, d: wm.update({"lm_head.weight": "model-9.safetensors"})),
     "missing shard model-9.safetensors"),
    ("shard_wrong_file", edit_map(wrong_file), "maps model.layers.0.block_sparse_moe.experts.0.w1.weight to"),
]


@pytest.mark.parametrize("edit,needle", [c[1:] for c in INDEX_CASES], ids=[c[0] for c in INDEX_CASES])
def test_bad_index(sharded, edit, needle):
    edit(sharded)
    before = snapshot(sharded)
    with pytest.raises(CheckpointError) as e:
        LLM(sharded)
    assert needle in str(e.value) and "\n" not in str(e.value), str(e.value)
    assert snapshot(sharded) == before


@pytest.mark.parametrize("dtype,code", [(torch.int32, "I32"), (torch.int8, "I8"), (torch.bool, "BOOL"),
                                        (torch.uint8, "U8")])
def test_non_floating_tensor(ckpt, dtype, code):
    f = ckpt / "model.safetensors"
    sd = load_file(f)
    key = "model.layers.1.mlp.experts.2.down_proj.weight"
    sd[key] = sd[key].to(dtype)
    save_file(sd, f)
    before = snapshot(ckpt)
    with pytest.raises(CheckpointError, match=f"tensor {key} in model.safetensors has dtype {code}; "
                                              "expected a floating dtype"):
        LLM(ckpt)
    assert snapshot(ckpt) == before


def test_cli_bad_index(sharded):
    edit_map(wrong_file)(sharded)
    before = snapshot(sharded)
    assert_one_line_error(run_cli("inspect", sharded), "specmoe: error:", "which does not contain it")
    assert snapshot(sharded) == before
