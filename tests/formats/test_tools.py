"""`specmoe quantize`, `specmoe inspect`'s expert formats and the perplexity tool (against transformers' loss)."""
from __future__ import annotations

import json
import math

import torch

from specmoe import LLM
from specmoe.cli import main
from specmoe.eval.perplexity import perplexity
from specmoe.experts.formats import ExpertShape, make_format
from specmoe.weights.checkpoint import Checkpoint


def cli(capsys, *args) -> tuple[int, str, str]:
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return rc, out, err


def test_quantize_writes_the_repack_that_loading_uses(tiny_ckpt, tmp_path, capsys):
    ck = tiny_ckpt("mixtral")
    rc, out, _ = cli(capsys, "quantize", ck, "--format", "int4", "--group-size", "64", "--repack-dir", tmp_path,
                     "--json")
    info = json.loads(out)
    assert rc == 0 and info["expert_format"] == "int4-g64" and not info["already_existed"]
    want = make_format("int4-g64", ExpertShape.of(Checkpoint(ck).config), torch.float32).stored_bytes
    assert info["bytes_per_expert"] == want and info["ratio"] < 0.5
    mtime = (tmp_path / info["file"].rsplit("/", 1)[1]).stat().st_mtime_ns
    rc, out, _ = cli(capsys, "quantize", ck, "--format", "int4", "--group-size", "64", "--repack-dir", tmp_path,
                     "--json")
    assert json.loads(out)["already_existed"]
    llm = LLM(ck, offload="disk", expert_format="int4-g64", repack_dir=tmp_path, cache_experts=2)
    llm.generate([[1, 2, 3]])
    assert llm.stats["bytes_per_expert"] == want and llm.stats["fetches"] > 0
    assert (tmp_path / info["file"].rsplit("/", 1)[1]).stat().st_mtime_ns == mtime  # read, not rewritten
    rc, _, err = cli(capsys, "quantize", ck, "--format", "int8", "--group-size", "32", "--repack-dir", tmp_path)
    assert rc == 2 and "--group-size is for --format int4" in err and err.count("\n") == 1


def test_inspect_lists_expert_formats(tiny_ckpt, tmp_path, capsys):
    ck = tiny_ckpt("qwen3_moe")
    rc, out, _ = cli(capsys, "inspect", ck, "--json")
    info = json.loads(out)
    cfg = Checkpoint(ck).config
    fmts = {f["expert_format"]: f for f in info["expert_formats"]}
    assert list(fmts) == ["checkpoint", "int8", "int4-g32", "int4-g64"]
    assert fmts["checkpoint"]["bytes_per_expert"] == cfg.expert_numel * 4  # an fp32 checkpoint
    for f in fmts.values():
        assert f["bytes_per_token_cold"] == f["bytes_per_expert"] * cfg.top_k * len(cfg.moe_layers)
    assert fmts["int8"]["ratio"] < 0.3  # a quarter of fp32, plus scales
    rc, out, _ = cli(capsys, "inspect", ck)
    assert "int4-g64" in out and "MiB/token" in out


def test_perplexity_matches_transformers_loss(tiny_ckpt, hf_model):
    ck = tiny_ckpt("olmoe")
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (9, 5, 14)]
    got = perplexity(LLM(ck, dtype="float32"), seqs, batch=2)
    hf = hf_model(ck)
    nll = 0.0
    with torch.no_grad():
        for s in seqs:
            ids = torch.tensor([s])
            nll += float(hf(ids, labels=ids).loss) * (len(s) - 1)
    n = sum(len(s) - 1 for s in seqs)
    assert got["tokens"] == n
    assert math.isclose(got["nll"], nll / n, rel_tol=1e-4) and math.isclose(got["perplexity"], math.exp(nll / n),
                                                                            rel_tol=1e-4)


def test_perplexity_cli_on_the_demo_model(tmp_path, capsys):
    rc, out, _ = cli(capsys, "perplexity", "--expert-format", "checkpoint", "int8", "--per-domain", "1",
                     "--max-tokens", "24", "--repack-dir", tmp_path, "--json")
    rows = json.loads(out)
    assert rc == 0 and [r["expert_format"] for r in rows] == ["checkpoint", "int8"]
    assert rows[0]["tokens"] == rows[1]["tokens"] > 40 and rows[0]["change_vs_first"] == 0.0
    assert rows[1]["perplexity"] != rows[0]["perplexity"] and abs(rows[1]["change_vs_first"]) < 0.05
    assert rows[1]["bytes_per_expert"] < 0.52 * rows[0]["bytes_per_expert"]
