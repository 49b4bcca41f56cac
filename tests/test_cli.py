"""The `specmoe` command: subprocess runs, JSON output, one-line errors with exit code 2."""
import json
import subprocess
import sys
from pathlib import Path

from specmoe.engine.llm import DEMO_MODEL


def run(*args, check=True):
    p = subprocess.run([sys.executable, "-m", "specmoe", *map(str, args)], capture_output=True, text=True,
                       timeout=300)
    if check:
        assert p.returncode == 0, p.stderr
    return p


def test_inspect_json(tiny_ckpt):
    info = json.loads(run("inspect", tiny_ckpt("qwen2_moe"), "--json").stdout)
    assert info["family"] == "qwen2_moe" and info["experts_per_layer"] == 8 and info["top_k"] == 2
    assert info["moe_layers"] == 2  # layer 1 is an mlp_only layer
    # 2 MoE layers × 8 experts × 3 matrices of 24×32 fp32
    assert info["expert_bytes"] == 2 * 8 * 3 * 24 * 32 * 4


def test_user_errors_are_one_line(tmp_path, tiny_ckpt):
    p = run("inspect", tmp_path / "missing", check=False)
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and "not found" in p.stderr
    p = run("generate", "--model", tiny_ckpt("mixtral"), "--prompt", "hi", check=False)
    assert p.returncode == 2 and "no tokenizer.json" in p.stderr and "Traceback" not in p.stderr
    p = run("generate", "--prompts-file", tmp_path / "nope.txt", check=False)
    assert p.returncode == 2 and "prompts file not found" in p.stderr


def test_generate_demo_model_json(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def add(a, b):"}) + "\n" + json.dumps({"prompt": "And God said"}))
    out = json.loads(run("generate", "--prompts-file", prompts, "--max-tokens", "8", "--json").stdout)
    assert Path(out["model"]) == DEMO_MODEL
    assert len(out["outputs"]) == 2 and all(len(o["token_ids"]) <= 8 for o in out["outputs"])
    assert out["stats"]["generated_tokens"] == sum(len(o["token_ids"]) for o in out["outputs"])


def test_an_interrupt_a_native_call_turns_into_another_error_still_reads_as_interrupted(monkeypatch, capsys):
    """safetensors' slice read turned a SIGINT into "ValueError: could not determine the shape of ... UntypedStorage":
    the CLI still says "interrupted" and exits 130, no traceback."""
    import argparse
    import os
    import signal

    import specmoe.cli as cli

    def func(args):
        try:
            os.kill(os.getpid(), signal.SIGINT)  # the CLI's handler raises KeyboardInterrupt here
            for _ in range(1000):
                pass
        except KeyboardInterrupt:
            raise ValueError("could not determine the shape of object type 'torch.storage.UntypedStorage'")

    parser = type("P", (), {"parse_args": lambda self, argv: argparse.Namespace(func=func)})()
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    old = signal.getsignal(signal.SIGINT)
    try:
        assert cli.main([]) == 130
    finally:
        signal.signal(signal.SIGINT, old)
        cli._interrupted.clear()
    assert "interrupted" in capsys.readouterr().err
