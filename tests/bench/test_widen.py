"""The widened copy (zero-padded hidden and expert width, rescaled norms and eps) computes the
same function: greedy tokens equal the original's (fp32 exactly, bf16 reported)."""
from __future__ import annotations

import json

import pytest
import torch

from specmoe.bench.widen import default_size, rule_of, widen_checkpoint, widened_copy
from specmoe.engine.llm import DEMO_MODEL


def _greedy(path, dtype, prompts, n=12):
    from specmoe import LLM, SamplingParams
    sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    return [o.token_ids for o in LLM(path, dtype=dtype, max_batch=len(prompts)).generate(prompts, sp)]


def test_rules_cover_qwen3_moe_keys():
    assert rule_of("model.layers.0.mlp.experts.3.down_proj.weight") == "exp_out"
    assert rule_of("model.layers.0.mlp.experts.3.gate_proj.weight") == "exp_in"
    assert rule_of("model.layers.0.mlp.gate.weight") == "hid1"
    assert rule_of("model.layers.0.self_attn.q_norm.weight") == "keep"
    assert rule_of("model.layers.0.post_attention_layernorm.weight") == "norm"
    with pytest.raises(ValueError):
        rule_of("model.layers.0.mystery.weight")


def test_widened_tiny_qwen3_moe_is_function_preserving(tiny_ckpt, tmp_path, hf_model):
    src = tiny_ckpt("qwen3_moe")
    dst = tmp_path / "wide"
    info = widen_checkpoint(src, dst, hidden=128, expert_intermediate=64)  # D 32→128 (4x), I 24→64
    cfg = json.loads((dst / "config.json").read_text())
    assert cfg["hidden_size"] == 128 and cfg["moe_intermediate_size"] == 64
    assert cfg["rms_norm_eps"] == pytest.approx(json.loads((src / "config.json").read_text())["rms_norm_eps"] / 4)
    assert info["bytes"] > 0
    prompts = [[1, 5, 9, 13, 17, 21, 25, 29], [3, 4, 5], [40, 41, 42, 43, 44, 45]]
    assert _greedy(dst, "float32", prompts) == _greedy(src, "float32", prompts)
    # transformers agrees that the widened config + weights compute the same logits
    x = torch.tensor([prompts[0]])
    with torch.no_grad():
        a, b = hf_model(src)(x).logits, hf_model(dst)(x).logits
    torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    # bf16: the norm scale is exactly 1/2, so only summation order can differ; reported, and equal here
    assert _greedy(dst, "bfloat16", prompts) == _greedy(src, "bfloat16", prompts)


def test_widened_copy_is_cached_and_checked(tiny_ckpt, tmp_path):
    src = tiny_ckpt("qwen3_moe")
    p1, info = widened_copy(src, cache_dir=tmp_path, expert_mb=0.05, progress=False)
    assert all(c["identical_sequences"] == c["sequences"] for c in info["greedy_check"] if c["dtype"] == "float32")
    p2, _ = widened_copy(src, cache_dir=tmp_path, expert_mb=0.05, progress=False)
    assert p1 == p2


@pytest.mark.slow
@pytest.mark.skipif(not (DEMO_MODEL / "config.json").is_file(), reason="demo model not trained yet")
def test_widened_demo_model_greedy(tmp_path):
    D2, I2 = default_size(DEMO_MODEL)
    assert 5 * 2**20 <= 3 * D2 * I2 * 2 <= 10 * 2**20, "experts of the widened demo model should be 5–10 MB"
    path, info = widened_copy(DEMO_MODEL, cache_dir=tmp_path, progress=False)
    fp32 = next(c for c in info["greedy_check"] if c["dtype"] == "float32")
    assert fp32["identical_sequences"] == fp32["sequences"]
    assert info["eagle_head"]["check"]["pad_max_abs"] == 0.0 and (path / "eagle" / "model.safetensors").is_file()


# ---------------------------------------------------------------- the EAGLE head widened with its target

def test_widened_eagle3_head_is_function_preserving(tmp_path):
    """A random EAGLE-3 head (fc over three target states, a 2·D-wide midlayer attention, its own norm and
    reduced lm_head): the widened head's output is the source's with zeros appended, its draft logits equal."""
    from specmoe.bench.widen import eagle_head_check, widen_eagle_head
    from specmoe.models.eagle import EagleConfig, EagleHead, load_eagle_head, save_eagle_head
    hc = EagleConfig(version=3, hidden_size=32, intermediate_size=40, num_layers=1, num_heads=4, num_kv_heads=2,
                     head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0, vocab_size=96, max_position_embeddings=64,
                     target_hidden_size=32, draft_vocab_size=24, fc_bias=False, aux_layers=(0, 1, 2))
    torch.manual_seed(0)
    head = EagleHead(hc)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0.0, 0.3)
    save_eagle_head(head, tmp_path / "src")
    info = widen_eagle_head(tmp_path / "src", tmp_path / "dst", hidden=128)
    assert info["hidden"] == [32, 128]
    wide = load_eagle_head(tmp_path / "dst", target_hidden=128)
    assert wide.hc.version == 3 and wide.hc.hidden_size == 128 and wide.hc.target_hidden_size == 128
    assert torch.equal(wide.d2t, head.d2t)
    chk = eagle_head_check(tmp_path / "src", tmp_path / "dst")
    assert chk["pad_max_abs"] == 0.0
    assert chk["max_abs_diff"] <= 1e-5 * max(1.0, chk["output_max_abs"])
    assert chk["logits_max_abs_diff"] <= 1e-4


@pytest.fixture(scope="module")
def wide_demo(tmp_path_factory):
    """The demo model widened 4x (D 256 → 1024) with its experts' width unchanged (expert_mb tiny): cheap."""
    if not (DEMO_MODEL / "config.json").is_file():
        pytest.skip("demo model not trained yet")
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # the build's greedy check runs tiny forwards (cf. the `one_thread` fixture)
    try:
        return widened_copy(DEMO_MODEL, cache_dir=tmp_path_factory.mktemp("wide"), expert_mb=0.05, progress=False)
    finally:
        torch.set_num_threads(n)


def test_widened_copy_carries_the_widened_eagle_head(wide_demo):
    from specmoe.bundled import default_eagle_head, demo_eagle_dir
    from specmoe.models.eagle import DRAFT_VOCAB, recommended_draft_vocab
    path, info = wide_demo
    h = info["eagle_head"]
    assert h["path"] == "eagle" and h["hidden"] == [256, 1024]
    assert h["check"]["pad_max_abs"] == 0.0 and h["check"]["max_abs_diff"] < 1e-4
    assert default_eagle_head(path) == path / "eagle"
    assert (path / "eagle" / DRAFT_VOCAB).read_bytes() == (demo_eagle_dir() / DRAFT_VOCAB).read_bytes()
    assert recommended_draft_vocab(path / "eagle") == recommended_draft_vocab(demo_eagle_dir())


def test_cached_copy_without_a_head_gets_one(wide_demo):
    """A copy cached before heads were widened (no eagle/, no record) gets its head on the next call."""
    import shutil
    path, info = wide_demo
    marker = path / "widen.json"
    saved = marker.read_text()
    try:
        shutil.rmtree(path / "eagle")
        marker.write_text(json.dumps({k: v for k, v in info.items() if k != "eagle_head"}))
        p2, info2 = widened_copy(DEMO_MODEL, cache_dir=path.parent, expert_mb=0.05, progress=False)
        assert p2 == path and (path / "eagle" / "model.safetensors").is_file()
        assert info2["eagle_head"]["source"] == info["eagle_head"]["source"]
        assert json.loads(marker.read_text())["eagle_head"]["path"] == "eagle"
    finally:
        marker.write_text(saved)


def _eagle_run(path, prompts, sp, **kw):
    """(outputs, every proposal's drafts per sequence) of drafter='eagle' on `path` (fp32, greedy)."""
    from specmoe import LLM
    from specmoe.decoding.drafters.eagle import EagleDrafter
    seen = []
    orig = EagleDrafter.propose_tree

    def spy(self, seqs, gammas, width, noise, hook=None):
        trees = orig(self, seqs, gammas, width, noise, hook)
        seen.append([(s.seq_id, t.tokens) for s, t in zip(seqs, trees)])
        return trees
    EagleDrafter.propose_tree = spy
    try:
        llm = LLM(path, dtype="float32", threads=1, decoding="specmoe", drafter="eagle", num_draft_tokens=4,
                  max_batch=len(prompts), **kw)
        outs = [o.token_ids for o in llm.generate(prompts, sp)]
    finally:
        EagleDrafter.propose_tree = orig
    return outs, seen, llm.stats


@pytest.mark.parametrize("vocab", [None, 0], ids=["recommended-draft-vocab", "full-vocab"])
def test_eagle_drafts_on_the_widened_model_equal_the_demo_models(wide_demo, one_thread, vocab):
    """drafter='eagle' without eagle_head on the widened copy finds its widened head; its proposals equal the
    demo head's on the demo model, proposal for proposal, and greedy output equals plain greedy decoding."""
    from specmoe import SamplingParams
    from tests.decoding.eagle_cases import prompts
    path, _ = wide_demo
    ps, sp = prompts(5), SamplingParams(max_tokens=16, ignore_eos=True)
    ref = _greedy(DEMO_MODEL, "float32", ps, n=16)
    assert _greedy(path, "float32", ps, n=16) == ref
    demo_out, demo_seen, _ = _eagle_run(DEMO_MODEL, ps, sp, eagle_draft_vocab=vocab)
    wide_out, wide_seen, st = _eagle_run(path, ps, sp, eagle_draft_vocab=vocab)
    assert st["drafter"] == "eagle" and st["eagle_head"] == str(path / "eagle")
    assert st["drafted_tokens"] > 0 and 0 < st["accepted_tokens"] < st["drafted_tokens"]
    assert len(wide_seen) >= 5 and wide_seen == demo_seen
    assert wide_out == demo_out == ref


def test_bench_runs_eagle_on_the_widened_model(wide_demo, one_thread, tmp_path):
    """`specmoe bench`'s widened sweep runs the `eagle` system on the widened copy (its widened head, found without
    eagle_head), lossless against the widened model's resident reference."""
    from specmoe.bench import preset, run_bench
    path, _ = wide_demo
    out = tmp_path / "res"
    cfg = preset("quick", model=str(DEMO_MODEL), out=str(out), systems=("resident",), tiers=("disk",),
                 batch_sizes=(2,), max_tokens=6, prompt_tokens=16, sweep_batch=2, gammas=(), draft_experts=(),
                 policies=False, substitutions=False, peers=(), cache_dir=str(path.parent), time_budget_s=None,
                 progress=False, plots=False, widened=True, widened_batches=(2,), widened_expert_mb=0.05,
                 widened_systems=("resident", "eagle"))
    run_bench(cfg)
    data = json.loads((out / "results.json").read_text())
    assert data["models"]["widened"]["widen"]["eagle_head"]["path"] == "eagle"
    rows = [r for r in data["runs"] if r["model"] == "widened" and r["system"] == "eagle"]
    assert rows and all(r["status"] == "ok" for r in rows), rows
    assert all(r["matches_reference"] == 1.0 and r["stats"]["drafter"] == "eagle" for r in rows)
    assert all(r["stats"]["eagle_head"] == str(path / "eagle") and r["tokens_per_step"] > 1.0 for r in rows)
