"""`specmoe plan`: predicted tokens/s by batch size for this machine (calibrated) and hardware profiles."""
from __future__ import annotations

import json

import pytest

from specmoe.cli import main
from specmoe.cli.plan import plan_rows
from specmoe.decoding.control.profiles import PROFILES, coefficients
from specmoe.weights.checkpoint import Checkpoint


def run(capsys, *args) -> tuple[int, str, str]:
    capsys.readouterr()
    try:
        rc = main(["plan", *map(str, args)])
    except SystemExit as e:  # argparse usage errors
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def test_plan_json_rows_are_predictions_for_every_profile(tiny_ckpt, capsys):
    rc, stdout, err = run(capsys, tiny_ckpt("qwen3_moe"), "--offload", "host", "--batch-sizes", "1,16", "--threads",
                          "1", "--json")
    assert rc == 0, err
    out = json.loads(stdout)
    assert set(out["profiles"]) == {"this", *PROFILES}
    assert "calibrated" in out["profiles"]["this"]["description"]
    for prof in out["profiles"].values():
        assert [r["batch"] for r in prof["rows"]] == [1, 16]
        for r in prof["rows"]:
            assert r["label"] == "predicted" and r["draft_experts"] == 4 and 0 <= r["gamma"] <= 4
            assert r["plain_tok_s"] > 0 and r["lru_tok_s"] >= r["plain_tok_s"] * 0.999 and r["specmoe_tok_s"] > 0


def test_plan_errors_are_one_line(tiny_ckpt, capsys):
    for args in (("--profiles", "tpu-v9"), ("--batch-sizes", "0"), ("--acceptance", "1.5"), ("--draft-experts", "99")):
        rc, _, err = run(capsys, tiny_ckpt("mixtral"), *args)
        assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, (args, err)


def test_a_slow_link_makes_speculation_pay_on_the_same_model(tiny_ckpt):
    """The roofline profiles: the same model on an SSD-fed CPU vs HBM + PCIe: a slower link raises the
    predicted speculative gain over LRU at a large batch (fetches dominate more)."""
    path = tiny_ckpt("mixtral", hidden_size=256, intermediate_size=512, num_local_experts=16)
    res = plan_rows(str(path), profiles=["h200-pcie5", "desktop-nvme4"], batches=(64,), draft_experts=4, gamma=4,
                    cache_fraction=0.25, acceptance=(0.9, 0.8, 0.7, 0.6))
    gain = {k: v["rows"][0]["specmoe_tok_s"] / v["rows"][0]["lru_tok_s"] for k, v in res["profiles"].items()}
    c = coefficients(PROFILES["desktop-nvme4"], Checkpoint(path).config)
    assert c.read_s > coefficients(PROFILES["h200-pcie5"], Checkpoint(path).config).read_s
    assert gain["desktop-nvme4"] > gain["h200-pcie5"], gain


@pytest.mark.parametrize("name", list(PROFILES))
def test_profiles_read_time_is_bytes_over_link(name, tiny_ckpt):
    cfg = Checkpoint(tiny_ckpt("mixtral")).config
    c = coefficients(PROFILES[name], cfg)
    assert c.read_gbps == pytest.approx(PROFILES[name].link_gbps)
    assert c.expert_bytes == cfg.expert_numel * 2
