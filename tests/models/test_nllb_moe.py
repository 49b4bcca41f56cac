"""NLLB-MoE (encoder–decoder, top-2 with capacity) against transformers' NllbMoeForConditionalGeneration: fp32 logits,
greedy generation, the router's capacity rule; offloaded == resident (encoder experts included); speculation ==
plain decoding; the text API and its errors. The reference's expert dispatch: see nllb_tiny.py."""
from __future__ import annotations

import pytest
import torch

from specmoe.decoding.runtime.sampling import SamplingParams
from specmoe.decoding.runtime.sequence import Sequence
from specmoe.engine.core import Request
from specmoe.engine.llm import LLM
from specmoe.errors import InputError, UnsupportedModelError
from tests.models import nllb_tiny as tiny

pytest.importorskip("transformers")

# (seed, overrides): sparse and dense layers in both stacks, odd sizes, tied/scaled embeddings, router bias
CONFIGS = {
    "base": (0, {}),
    "odd": (1, dict(d_model=30, encoder_layers=2, decoder_layers=4, encoder_attention_heads=5,
                    decoder_attention_heads=3, encoder_ffn_dim=14, decoder_ffn_dim=14, num_experts=5,
                    encoder_sparse_step=1, decoder_sparse_step=3, tie_word_embeddings=True, scale_embedding=True)),
    "dense-encoder": (2, dict(encoder_sparse_step=0, decoder_sparse_step=1, encoder_ffn_dim=18, decoder_ffn_dim=14,
                              router_bias=True, moe_token_dropout=0.0, num_experts=7)),
}
SOURCES = [[4, 10, 11, 12, 13, 14, 9, 15, 2], [5, 16, 17, 2], [4, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 2]]
FRA = tiny.vocab()["fra_Latn"]


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny models run on one intra-op thread (the root conftest's `one_thread`)."""


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("nllb")
    return {name: tiny.save_tiny(root / name, seed, **kw) for name, (seed, kw) in CONFIGS.items()}


def our_logits(llm: LLM, sources: list[list[int]], prefixes: list[list[int]]) -> list[torch.Tensor]:
    """The decoder's logits [T, V] of each (source, decoder prefix), all rows in one ragged forward."""
    runner = llm.runner(len(sources), max(map(len, prefixes)))
    seqs = [Sequence(seq_id=i, prompt_ids=p, params=SamplingParams(), slot=i, generator=torch.Generator(),
                     source_ids=s) for i, (s, p) in enumerate(zip(sources, prefixes))]
    for s in seqs:
        runner.encode(s)
    out = runner.forward(seqs, prefixes, all_logits=True)
    return [out[b, :len(p)] for b, p in enumerate(prefixes)]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(ckpts, name):
    path = ckpts[name]
    hf, llm = tiny.hf_model(path), LLM(path, dtype="float32")
    prefixes = [[2, FRA, 10, 11], [2, FRA], [2, FRA, 30, 31, 32, 33, 34]]
    mine = our_logits(llm, SOURCES, prefixes)
    with tiny.fixed_experts(), torch.no_grad():
        for src, pre, got in zip(SOURCES, prefixes, mine):
            ref = hf(input_ids=torch.tensor([src]), decoder_input_ids=torch.tensor([pre])).logits[0]
            assert (got - ref).abs().max().item() < 1e-4


def test_transformers_5_24_dispatch_uses_experts_0_and_1(ckpts):
    """Why the reference patches transformers' expert dispatch (nllb_tiny.py): unpatched, 5.24 computes expert 1 for
    each token's first choice and expert 0 for its second. If this fails, transformers fixed it: drop the patch."""
    from transformers.models.nllb_moe.modeling_nllb_moe import NllbMoeSparseMLP
    hf = tiny.hf_model(ckpts["base"])
    mlp = next(m for m in hf.modules() if isinstance(m, NllbMoeSparseMLP))
    x = torch.randn(1, 9, 24, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        got = mlp(x).view(9, 24)
        _, probs, _ = mlp.router(x.view(9, 24))
        top1, top2 = probs.topk(2, dim=-1)[1].unbind(-1)
        w1, w2 = probs.gather(1, top1[:, None]), probs.gather(1, top2[:, None])
        h = x.view(9, 24)
        as_0_1 = (mlp.experts["expert_1"](h) * w1 + mlp.experts["expert_0"](h) * w2) * 0.8
    assert torch.allclose(got, as_0_1, atol=1e-6)
    assert not set(top1.tolist()) <= {1}  # the router did pick other experts


@pytest.mark.parametrize("name", list(CONFIGS))
def test_greedy_matches_transformers_generate(ckpts, name):
    path = ckpts[name]
    hf, llm = tiny.hf_model(path), LLM(path, dtype="float32")
    outs = llm.generate(SOURCES, SamplingParams(max_tokens=12), target_lang=FRA)
    distinct = set()
    with tiny.fixed_experts():
        for src, o in zip(SOURCES, outs):
            ref = hf.generate(torch.tensor([src]), forced_bos_token_id=FRA, max_new_tokens=13, do_sample=False,
                              num_beams=1)[0].tolist()
            assert ref[:2] == [2, FRA] and o.token_ids == ref[2:]
            distinct |= set(o.token_ids)
    assert len(distinct) >= 2  # not one token repeated


@pytest.mark.parametrize("fraction,capacity,prioritized,before", [
    (0.3, 64, False, False), (0.3, 64, True, True), (0.5, 64, True, False), (-1.0, 2, False, True)])
def test_capacity_router_matches_transformers(fraction, capacity, prioritized, before):
    from transformers import NllbMoeConfig
    from transformers.models.nllb_moe.modeling_nllb_moe import NllbMoeTop2Router

    from specmoe.config import Capacity
    from specmoe.models.routers import top2_capacity
    N, E = 13, 4
    cfg = NllbMoeConfig(d_model=8, num_experts=E, expert_capacity=capacity, moe_eval_capacity_token_fraction=fraction,
                        batch_prioritized_routing=prioritized, normalize_router_prob_before_dropping=before)
    router = NllbMoeTop2Router(cfg).eval()
    logits = torch.randn(N, E, generator=torch.Generator().manual_seed(3)) * 2
    _, ref = router.route_tokens(logits.clone())  # [N, E]: the combine weights (0 where dropped)
    w, ids = top2_capacity(logits, torch.float32, Capacity(fraction, capacity, prioritized, before))
    mine = torch.zeros(N, E).scatter_add_(1, ids, w)
    assert torch.equal(mine, ref)
    assert (w == 0).any()  # the capacity dropped assignments


def test_encoder_capacity_matches_transformers_generate(tmp_path):
    """A binding capacity in the encoder (fraction 0.25 of the source's tokens): the encoder runs each source alone,
    as transformers does at batch 1; the decoder, token by token in transformers' generate, never drops."""
    path = tiny.save_tiny(tmp_path / "cap", seed=4, moe_eval_capacity_token_fraction=0.25, encoder_sparse_step=1)
    hf, llm = tiny.hf_model(path), LLM(path, dtype="float32")
    outs = llm.generate(SOURCES, SamplingParams(max_tokens=10), target_lang=FRA)
    with tiny.fixed_experts():
        for src, o in zip(SOURCES, outs):
            ref = hf.generate(torch.tensor([src]), forced_bos_token_id=FRA, max_new_tokens=11, do_sample=False)
            assert o.token_ids == ref[0].tolist()[2:]
    free = LLM(tiny.save_tiny(tmp_path / "free", seed=4, encoder_sparse_step=1), dtype="float32")
    ours = our_logits(llm, SOURCES[2:], [[2, FRA]])[0]
    assert not torch.equal(ours, our_logits(free, SOURCES[2:], [[2, FRA]])[0])  # the rule changed the encoder


def run_core(llm: LLM, params: SamplingParams, sources=SOURCES):
    """(token ids, logprobs) per source, through the engine core with logprobs recorded."""
    reqs = [Request(prompt_ids=[2, FRA], params=params, source_ids=s, logprobs=2) for s in sources]
    with llm.engine([(r.prompt_ids, params) for r in reqs]) as core:
        for r in reqs:
            core.add(r)
        while core.has_work:
            core.step()
    return [(r.output_ids, [(t.logprob, t.top) for t in r.token_logprobs]) for r in reqs]


@pytest.mark.parametrize("name,offload,policy", [("base", "disk", "lru"), ("base", "host", "ondemand"),
                                                 ("odd", "disk", "ondemand"), ("odd", "host", "lru")])
def test_offloaded_equals_resident(ckpts, name, offload, policy):
    """"odd": sizes F.grouped_mm does not take (the per-slot fallback), every encoder layer sparse."""
    path = ckpts[name]
    params = SamplingParams(max_tokens=8)
    ref = run_core(LLM(path, dtype="float32"), params)
    llm = LLM(path, dtype="float32", offload=offload, cache_experts=2, cache_policy=policy)
    assert run_core(llm, params) == ref  # token ids and logprobs, bit for bit
    s = llm.stats
    Le = llm.config.seq2seq.encoder_layers
    enc = [i for i, layer in enumerate(llm.config.moe_layers) if layer < Le]
    assert enc and all(s["misses_per_layer"][i] > 0 for i in enc)  # encoder experts came through the cache
    assert s["misses_per_layer"][-1] > 0


@pytest.mark.parametrize("drafter", ["self", "ngram"])
def test_speculative_greedy_equals_plain(ckpts, drafter):
    path = ckpts["base"]
    params = SamplingParams(max_tokens=16, ignore_eos=True)
    ref = run_core(LLM(path, dtype="float32"), params)
    llm = LLM(path, dtype="float32", decoding="specmoe", drafter=drafter, draft_experts=2, num_draft_tokens=3)
    got = run_core(llm, params)
    assert [g[0] for g in got] == [r[0] for r in ref]
    s = llm.stats
    assert s["accepted_tokens"] > 0 and s["drafted_tokens"] > s["accepted_tokens"]  # accepted and rejected
    if drafter == "self":  # the encoder is never drafted: no draft experts pinned there
        assert sorted(s["draft_set"]) == list(llm.config.draft_layers) == [4]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_speculative_equals_plain(ckpts, dtype):
    """Half precision on CPU takes the batch-invariant attention (multi-head: one query head per key head)."""
    path = ckpts["odd"]
    params = SamplingParams(max_tokens=10, ignore_eos=True)
    plain = LLM(path, dtype=dtype).generate(SOURCES, params, target_lang=FRA)
    llm = LLM(path, dtype=dtype, decoding="specmoe", draft_experts=2, offload="host", cache_experts=3)
    assert [o.token_ids for o in llm.generate(SOURCES, params, target_lang=FRA)] == [o.token_ids for o in plain]
    assert llm.stats["drafted_tokens"] > 0


def test_multi_head_attention_half_precision_decoder_only(tiny_ckpt):
    """A decoder-only model whose every query head has its own key head (Qwen1.5-MoE's layout) in bf16 on CPU: the
    fixed-split attention's query and output reshapes (a `view` of the transposed queries used to fail)."""
    llm = LLM(tiny_ckpt("qwen2_moe", num_key_value_heads=4), dtype="bfloat16")
    assert llm.config.num_kv_heads == llm.config.num_heads
    assert len(llm.generate([list(range(3, 40))], SamplingParams(max_tokens=4))[0].token_ids) == 4


def test_speculative_seeded_equals_plain_seeded(ckpts):
    path = ckpts["dense-encoder"]
    params = [SamplingParams(max_tokens=12, temperature=0.9, seed=s, ignore_eos=True) for s in (1, 2, 3)]
    plain = LLM(path, dtype="float32").generate(SOURCES, params, target_lang=FRA)
    llm = LLM(path, dtype="float32", decoding="specmoe", drafter="self", draft_experts=3, num_draft_tokens=3)
    spec = llm.generate(SOURCES, params, target_lang=FRA)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert llm.stats["accepted_tokens"] > 0


def test_text_api_builds_nllb_inputs(ckpts):
    path = ckpts["base"]
    llm, v = LLM(path, dtype="float32"), tiny.vocab()
    text = "the cat sat on the mat"
    ids = [v["deu_Latn"]] + [v[w] for w in text.split()] + [2]
    by_text = llm.generate(text, SamplingParams(max_tokens=6), target_lang="fra_Latn", source_lang="deu_Latn")[0]
    by_ids = llm.generate([ids], SamplingParams(max_tokens=6), target_lang=FRA)[0]
    assert by_text.token_ids == by_ids.token_ids and by_text.prompt == text
    assert by_text.prompt_token_ids == [2, FRA]
    assert by_text.text == llm.decode(by_text.token_ids) and "fra_Latn" not in by_text.text
    default = llm.generate(text, SamplingParams(max_tokens=6), target_lang="fra_Latn")[0]  # source: eng_Latn
    eng = llm.generate([[v["eng_Latn"]] + ids[1:]], SamplingParams(max_tokens=6), target_lang=FRA)[0]
    assert default.token_ids == eng.token_ids
    per_prompt = llm.generate([text, text], SamplingParams(max_tokens=6), target_lang=["fra_Latn", "spa_Latn"])
    assert per_prompt[0].token_ids == default.token_ids
    assert llm.stats["memory"]["cross_kv_cache"] > 0


def test_translation_errors(ckpts, tiny_ckpt):
    llm = LLM(ckpts["base"], dtype="float32")
    with pytest.raises(InputError, match="give target_lang"):
        llm.generate("the cat")
    with pytest.raises(InputError, match="unknown target_lang 'xyz_Latn'"):
        llm.generate("the cat", target_lang="xyz_Latn")
    with pytest.raises(InputError, match="2 target_lang values for 1 prompts"):
        llm.generate("the cat", target_lang=["fra_Latn", "deu_Latn"])
    with pytest.raises(InputError, match="encoder–decoder"):
        llm.logits([[4, 10, 2]])
    with pytest.raises(InputError, match="decoder-only"):
        LLM(tiny_ckpt("mixtral")).generate([[1, 2, 3]], target_lang="fra_Latn")
    with pytest.raises(UnsupportedModelError, match="decoding='auto' and the eagle drafter"):
        LLM(ckpts["base"], decoding="auto")
    with pytest.raises(UnsupportedModelError, match="profiling the experts"):
        LLM(ckpts["base"], offload="host", cache_policy="static", cache_experts=3)


def test_unsupported_configs(tmp_path):
    from specmoe.families import read_config
    import json
    path = tiny.save_tiny(tmp_path / "m")
    raw = json.loads((path / "config.json").read_text())
    for key, value, match in (("second_expert_policy", "sampling", "second_expert_policy"),
                              ("activation_function", "gelu", "activation_function"),
                              ("decoder_ffn_dim", 16, "two sizes")):
        with pytest.raises(UnsupportedModelError, match=match):
            read_config({**raw, key: value})
    from specmoe.errors import CheckpointError
    with pytest.raises(CheckpointError, match="d_model must be a multiple of encoder_attention_heads"):
        read_config({**raw, "encoder_attention_heads": 5})
    (path / "config.json").write_text(json.dumps({**raw, "num_experts": raw["num_experts"] + 1}))
    with pytest.raises(CheckpointError, match="missing .* tensor"):
        LLM(path)
    (path / "config.json").write_text(json.dumps({**raw, "decoder_ffn_dim": 16, "encoder_ffn_dim": 16}))
    with pytest.raises(CheckpointError, match="shape"):
        LLM(path)


def test_cli_translate_and_inspect(ckpts, capsys, tmp_path):
    from specmoe.cli import main
    path = ckpts["base"]
    want = LLM(path, dtype="float32").generate(["the cat sat", "a bird"], SamplingParams(max_tokens=5),
                                                target_lang="deu_Latn", source_lang="spa_Latn")
    assert main(["translate", "--model", str(path), "--dtype", "float32", "--target-lang", "deu_Latn",
                 "--source-lang", "spa_Latn", "--max-tokens", "5", "the cat sat", "a bird"]) == 0
    out = capsys.readouterr().out
    assert out == "".join(f"--- prompt: {o.prompt!r}\n{o.text}\n" for o in want)
    rows = tmp_path / "src.jsonl"  # a row's own languages win over the flags
    rows.write_text('{"prompt": "the cat sat", "target_lang": "deu_Latn"}\n{"prompt": "a bird", "source_lang": '
                    '"spa_Latn"}\n')
    want = LLM(path, dtype="float32").generate(["the cat sat", "a bird"], SamplingParams(max_tokens=5),
                                                target_lang=["deu_Latn", "fra_Latn"], source_lang=["eng_Latn", "spa_Latn"])
    assert main(["translate", "--model", str(path), "--dtype", "float32", "--target-lang", "fra_Latn",
                 "--prompts-file", str(rows), "--max-tokens", "5", "--json"]) == 0
    import json
    assert [o["token_ids"] for o in json.loads(capsys.readouterr().out)["outputs"]] == [o.token_ids for o in want]
    assert main(["translate", "--model", str(path), "--target-lang", "xyz", "a"]) == 2
    assert "unknown target_lang 'xyz'" in capsys.readouterr().err
    assert main(["generate", "--model", str(path), "--prompt", "a"]) == 2
    assert "give target_lang" in capsys.readouterr().err
    assert main(["inspect", str(ckpts["odd"]), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["encoder_layers"] == "moe, moe" and info["decoder_layers"] == "dense, dense, moe, dense"
    assert info["layers"] == 6 and info["moe_layers"] == 3 and info["attention"] == "mha+cross"


def test_server_completion_with_target_lang(ckpts):
    from tests.serve.conftest import need_server, start_server
    need_server()
    import httpx
    path = ckpts["base"]
    want = LLM(path, dtype="float32").generate("the cat sat", SamplingParams(max_tokens=5), target_lang="fra_Latn")
    srv = start_server({"model": path})
    try:
        from specmoe.serve.config import served_name
        body = {"model": served_name(srv.llm, srv.app.state.config), "prompt": "the cat sat", "max_tokens": 5, "temperature": 0}
        r = httpx.post(srv.url + "/v1/completions", json={**body, "target_lang": "fra_Latn"}, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == want[0].text
        r = httpx.post(srv.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 400 and "target_lang" in r.json()["error"]["message"]
    finally:
        srv.stop()
