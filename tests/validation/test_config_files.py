"""config.json and generation_config.json: wrong shape, wrong types, non-UTF-8, broken invariants.
Each is a CheckpointError (a SpecMoEError) naming the file and field, and changes no file."""
import json

import pytest

from specmoe import LLM
from specmoe.families import load_config
from specmoe.errors import CheckpointError, SpecMoEError
from tests.validation.conftest import assert_one_line_error, run_cli, snapshot


def setk(**kv):
    return lambda c: {**c, **kv}


def delk(*keys):
    return lambda c: {k: v for k, v in c.items() if k not in keys}


# (case id, edit of the parsed config.json -> new JSON value, or raw bytes; text the message must contain)
CONFIG_CASES = [
    ("list", lambda c: [c], "must hold a JSON object, got a list"),
    ("null", lambda c: None, "must hold a JSON object, got null"),
    ("number", lambda c: 3, "must hold a JSON object, got an integer"),
    ("non_utf8", b'{"model_type": "qwen3_moe", "x": "\xff\xfe"}', "not UTF-8"),
    ("bad_json", b'{"model_type": "qwen3_moe",', "not valid JSON"),
    ("hidden_size_string", setk(hidden_size="32"), "hidden_size must be an integer >= 1; got '32'"),
    ("layers_float", setk(num_hidden_layers=3.0), "num_hidden_layers must be an integer >= 1; got 3.0"),
    ("vocab_bool", setk(vocab_size=True), "vocab_size must be an integer"),
    ("hidden_size_negative", setk(hidden_size=-32), "hidden_size must be an integer >= 1; got -32"),
    ("vocab_zero", setk(vocab_size=0), "vocab_size must be an integer >= 1; got 0"),
    ("zero_experts", setk(num_local_experts=0), "num_local_experts must be an integer >= 1; got 0"),
    ("missing_experts", delk("num_local_experts", "num_experts"), "num_local_experts / num_experts must be an integer >= 1; it is missing"),
    ("topk_gt_experts", setk(num_experts_per_tok=9), "num_experts_per_tok must be an integer in [1, 8]; got 9"),
    ("topk_zero", setk(num_experts_per_tok=0), "num_experts_per_tok must be an integer in [1, 8]; got 0"),
    ("kv_not_dividing", setk(num_key_value_heads=3), "num_key_value_heads must be a divisor of num_attention_heads"),
    ("kv_gt_heads", setk(num_key_value_heads=8), "num_key_value_heads must be an integer in [1, 4]"),
    ("kv_zero", setk(num_key_value_heads=0), "num_key_value_heads must be an integer in [1, 4]"),
    ("moe_size_zero", setk(moe_intermediate_size=0), "moe_intermediate_size must be an integer >= 1"),
    ("eps_nan", setk(rms_norm_eps=float("nan")), "rms_norm_eps must be a finite number > 0"),
    ("eps_string", setk(rms_norm_eps="1e-6"), "rms_norm_eps must be a finite number > 0"),
    ("rope_theta_negative", lambda c: {**c, "rope_parameters": {"rope_type": "default", "rope_theta": -1}},
     "rope_theta must be a finite number > 0"),
    ("rope_parameters_list", setk(rope_parameters=[1]), "rope_parameters must be an object or null"),
    ("tie_string", setk(tie_word_embeddings="false"), "tie_word_embeddings must be true or false; got 'false'"),
    ("norm_topk_int", setk(norm_topk_prob=1), "norm_topk_prob must be true or false"),
    ("dtype_int", setk(dtype="int8", torch_dtype="int8"), "dtype must be a floating dtype name"),
    ("dtype_number", setk(dtype=32, torch_dtype=None), "dtype must be a floating dtype name"),
    ("max_pos_zero", setk(max_position_embeddings=0), "max_position_embeddings must be an integer >= 2"),
    ("sparse_step_zero", setk(decoder_sparse_step=0), "decoder_sparse_step must be an integer >= 1"),
    ("mlp_only_out_of_range", setk(mlp_only_layers=[7]), "mlp_only_layers must be a list of layer indices in [0, 3)"),
    ("mlp_only_all", setk(mlp_only_layers=[0, 1, 2]), "leave at least one MoE layer"),
    ("eos_string", setk(eos_token_id="</s>"), "eos_token_id must be a token id, a list of token ids, or null"),
    ("hidden_act_list", setk(hidden_act=["silu"]), "hidden_act must be a string"),
    ("head_dim_zero", setk(head_dim=0), "head_dim must be an integer >= 1; got 0"),
    ("experts_huge", setk(num_local_experts=10**12, num_experts_per_tok=2), "too few for the 3 layers x 1000000000000 experts"),
]

GEN_CASES = [
    ("list", b"[1, 2]", "generation_config.json must hold a JSON object, got a list"),
    ("null", b"null", "generation_config.json must hold a JSON object, got null"),
    ("non_utf8", b'{"eos_token_id": "\xc3\x28"}', "not UTF-8"),
    ("bad_json", b'{"eos_token_id": ', "not valid JSON"),
    ("eos_float", b'{"eos_token_id": 2.5}', "generation_config.json: eos_token_id must be a token id"),
    ("eos_list_of_str", b'{"eos_token_id": ["a"]}', "generation_config.json: eos_token_id must be a token id"),
]


def write(path, edit):
    if isinstance(edit, bytes):
        path.write_bytes(edit)
    else:
        path.write_text(json.dumps(edit(json.loads(path.read_text()))))


@pytest.mark.parametrize("edit,needle", [c[1:] for c in CONFIG_CASES], ids=[c[0] for c in CONFIG_CASES])
def test_bad_config_json(ckpt, edit, needle):
    write(ckpt / "config.json", edit)
    before = snapshot(ckpt)
    with pytest.raises(CheckpointError) as e:
        LLM(ckpt)
    msg = str(e.value)
    assert "config.json" in msg and needle in msg and "\n" not in msg, msg
    assert snapshot(ckpt) == before


@pytest.mark.parametrize("data,needle", [c[1:] for c in GEN_CASES], ids=[c[0] for c in GEN_CASES])
def test_bad_generation_config(ckpt, data, needle):
    (ckpt / "generation_config.json").write_bytes(data)
    before = snapshot(ckpt)
    with pytest.raises(CheckpointError, match="generation_config.json") as e:
        LLM(ckpt)
    assert needle in str(e.value), str(e.value)
    assert snapshot(ckpt) == before


def test_valid_configs_still_parse(tiny_ckpt):
    """Control: the fixtures of every family and the demo model parse, with their real values."""
    from specmoe.engine.llm import DEMO_MODEL
    for fam in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe"):
        cfg = load_config(tiny_ckpt(fam))
        assert cfg.num_experts == 8 and cfg.top_k == 2 and cfg.num_kv_heads == 2
    demo = load_config(DEMO_MODEL)
    assert demo.dtype == "bfloat16" and demo.eos_token_ids == (0,) and demo.num_experts == 32


def test_cli_bad_config_is_one_line(ckpt):
    write(ckpt / "config.json", setk(num_experts_per_tok="2"))
    before = snapshot(ckpt)
    p = run_cli("inspect", ckpt)
    assert_one_line_error(p, "specmoe: error:", "num_experts_per_tok must be an integer in [1, 8]; got '2'")
    p = run_cli("generate", "--model", ckpt, "--prompt", "x")
    assert_one_line_error(p, "num_experts_per_tok")
    assert snapshot(ckpt) == before
    assert issubclass(CheckpointError, SpecMoEError)


def test_missing_num_key_value_heads_means_one_per_attention_head(tiny_ckpt, tmp_path):
    """transformers' rule: a config without num_key_value_heads is multi-head attention (as many K/V heads as
    attention heads), not one K/V head. An MHA checkpoint with the key dropped reads so and decodes as with it."""
    import shutil
    from tests.validation.conftest import NO_REPACK
    src = tiny_ckpt("qwen3_moe", num_key_value_heads=4)
    dst = tmp_path / "mha"
    shutil.copytree(src, dst, ignore=NO_REPACK)
    write(dst / "config.json", delk("num_key_value_heads"))
    assert "num_key_value_heads" not in json.loads((dst / "config.json").read_text())
    cfg = load_config(dst)
    assert cfg.num_heads == 4 and cfg.num_kv_heads == 4
    assert load_config(dst).num_kv_heads == load_config(src).num_kv_heads
    ps = [[1, 2, 3, 4], [5, 6]]
    want = [o.token_ids for o in LLM(src, dtype="float32").generate(ps)]
    assert [o.token_ids for o in LLM(dst, dtype="float32").generate(ps)] == want


@pytest.mark.parametrize("step,mlp_only,moe", [(1, [], (0, 1, 2)), (2, [], (1,)), (3, [], (2,)), (1, [0, 2], (1,))])
def test_sparse_step_picks_the_moe_layers(ckpt, step, mlp_only, moe):
    """Qwen's rule: layer i is MoE iff (i + 1) is a multiple of decoder_sparse_step and i is not in
    mlp_only_layers (3 layers here)."""
    write(ckpt / "config.json", setk(decoder_sparse_step=step, mlp_only_layers=mlp_only))
    assert load_config(ckpt).moe_layers == moe


def test_qwen2_moe_without_qkv_bias_has_the_biases(tiny_ckpt, tmp_path):
    """Qwen1.5-MoE's config.json has no qkv_bias key, and its q/k/v projections are biased: a qwen2_moe config
    without the key reads qkv_bias = true, and the checkpoint loads and decodes as with the key."""
    import shutil
    from tests.validation.conftest import NO_REPACK
    src = tiny_ckpt("qwen2_moe")
    assert json.loads((src / "config.json").read_text())["qkv_bias"] is True
    dst = tmp_path / "qwen15"
    shutil.copytree(src, dst, ignore=NO_REPACK)
    write(dst / "config.json", delk("qkv_bias"))
    assert load_config(dst).qkv_bias is True
    ps = [[1, 2, 3, 4], [5, 6]]
    want = [o.token_ids for o in LLM(src, dtype="float32").generate(ps)]
    assert [o.token_ids for o in LLM(dst, dtype="float32").generate(ps)] == want
