"""The bundled demo model: transformers loads the shipped directory and its logits equal ours."""
import json
from pathlib import Path

import torch

from specmoe import LLM, SamplingParams
from specmoe.engine.llm import DEMO_MODEL

PROMPTS = Path(__file__).resolve().parents[2] / "benchmarks" / "prompts"


def heldout_prompts(n_per_domain=1):
    out = []
    for f in sorted(PROMPTS.glob("*.jsonl")):
        lines = f.read_text().splitlines()[:n_per_domain]
        out += [json.loads(line)["prompt"] for line in lines]
    return out


def test_demo_model_matches_transformers():
    from transformers import AutoModelForCausalLM, AutoTokenizer
    cfg = json.loads((DEMO_MODEL / "config.json").read_text())
    assert cfg["model_type"] == "qwen3_moe" and cfg["num_experts_per_tok"] == 2
    hf = AutoModelForCausalLM.from_pretrained(DEMO_MODEL, dtype=torch.float32).eval()
    llm = LLM(dtype="float32")  # default = the demo model
    prompts = heldout_prompts()
    assert len(prompts) >= 4
    hf_tok = AutoTokenizer.from_pretrained(DEMO_MODEL)
    ids = [llm.tokenizer.encode(p)[:64] for p in prompts]
    assert ids[0] == hf_tok(prompts[0])["input_ids"][:64] and ids[0][0] == 0  # BOS, as in training
    ours = llm.logits(ids)
    for b, t in enumerate(ids):
        with torch.no_grad():
            ref = hf(torch.tensor([t])).logits[0]
        assert (ours[b, :len(t)] - ref).abs().max().item() <= 1e-4
    out = llm.generate([ids[0]], SamplingParams(max_tokens=16, ignore_eos=True))[0]
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids[0]]), attention_mask=torch.ones(1, len(ids[0]), dtype=torch.long),
                          max_new_tokens=16, min_new_tokens=16, do_sample=False)[0, len(ids[0]):].tolist()
    assert out.token_ids == ref
    assert isinstance(out.text, str) and out.text
