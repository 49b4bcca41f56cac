"""Experts of checkpoints that ship them quantized, kept and moved as stored (mxfp4, fp8-block) against the same
model's experts in bf16: stored bytes per expert, and bytes moved per generated token at equal cache slots.

    python benchmarks/native_formats.py [--slots 3] [--tokens 16] [--out FILE]

Models: the tiny test checkpoints of tests/formats/native.py (GPT-OSS with random MXFP4 experts, DeepSeek-V3 with
every linear block-quantized to FP8), and for each a bf16 copy of the same model (every weight dequantised by
specmoe's reader and rounded to bf16, float key layout; MXFP4 values are exact in bf16, FP8 products are rounded,
so the bf16 copy of the FP8 model may route a token differently). Each model runs the same prompts one at a time
(batch 1, greedy, fp32 compute) on the host tier with an LRU cache of `--slots` slots per MoE layer, cold.

Also, computed from the published configs' shapes (no weights needed): the stored bytes per expert of GPT-OSS
(MXFP4) and DeepSeek-V3 (FP8, 128x128 blocks) against bf16, and the time this machine takes to decode one such
expert on arrival (random stored bytes, best of a few) next to the bf16 -> fp32 upcast of the same expert.
Writes benchmarks/results/native_formats.json.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from specmoe import LLM, SamplingParams  # noqa: E402
from specmoe.bench.machine import provenance  # noqa: E402
from specmoe.families import read_config  # noqa: E402
from specmoe.experts.formats import ExpertShape, Native, Plain  # noqa: E402
from specmoe.machine_cache import cpu_model  # noqa: E402
from specmoe.weights.checkpoint import Checkpoint  # noqa: E402
from specmoe.weights.names import expert_parts, non_expert_keys  # noqa: E402
from tests.formats.native import make_fp8_checkpoint, make_mxfp4_checkpoint  # noqa: E402

PROMPTS = [[5, 9, 3, 7, 2, 8, 11, 40], [4, 6, 10], [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24], [30],
           [60, 61, 62, 63, 64], [7, 1, 2]]
# the published configs' expert shapes (hidden, expert intermediate, experts per layer, top-k, MoE layers)
PUBLISHED = {
    "gpt-oss-120b (mxfp4)": dict(model_type="gpt_oss", hidden_size=2880, intermediate_size=2880, num_local_experts=128,
                                 num_experts_per_tok=4, num_hidden_layers=36, num_attention_heads=64,
                                 num_key_value_heads=8, head_dim=64, vocab_size=201088,
                                 quantization_config={"quant_method": "mxfp4"}, torch_dtype="bfloat16"),
    "DeepSeek-V3 (fp8, 128x128)": dict(model_type="deepseek_v3", hidden_size=7168, intermediate_size=18432,
                                       moe_intermediate_size=2048, n_routed_experts=256, num_experts_per_tok=8,
                                       num_hidden_layers=61, first_k_dense_replace=3, num_attention_heads=128,
                                       num_key_value_heads=128, vocab_size=129280, q_lora_rank=1536,
                                       kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
                                       torch_dtype="bfloat16",
                                       quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}),
}


def bf16_copy(src: Path, dst: Path) -> Path:
    """The model of a quantized checkpoint as a bf16 checkpoint with the floating-point key layout."""
    ck = Checkpoint(src)
    cfg = ck.config
    out = {key: ck.get(key, torch.bfloat16) for key, _ in non_expert_keys(cfg).values()}
    I, D = cfg.expert_intermediate_size, cfg.hidden_size
    for layer in cfg.moe_layers:
        experts = [ck.read_expert(layer, e, torch.bfloat16) for e in range(cfg.num_experts)]
        gate = torch.stack([w[: I * D].view(I, D) for w in experts])
        up = torch.stack([w[I * D: 2 * I * D].view(I, D) for w in experts])
        down = torch.stack([w[2 * I * D: 3 * I * D].view(D, I) for w in experts])
        if cfg.model_type == "gpt_oss":  # fused [E, D, 2I] with gate/up interleaved, [E, I, D], and the biases
            b = f"model.layers.{layer}.mlp.experts."
            gu = torch.empty(cfg.num_experts, D, 2 * I, dtype=torch.bfloat16)
            gu[..., 0::2], gu[..., 1::2] = gate.transpose(1, 2), up.transpose(1, 2)
            out[b + "gate_up_proj"], out[b + "down_proj"] = gu, down.transpose(1, 2).contiguous()
            bias = torch.stack([w[3 * I * D:] for w in experts])
            gub = torch.empty(cfg.num_experts, 2 * I, dtype=torch.bfloat16)
            gub[:, 0::2], gub[:, 1::2] = bias[:, :I], bias[:, I:2 * I]
            out[b + "gate_up_proj_bias"], out[b + "down_proj_bias"] = gub, bias[:, 2 * I:].contiguous()
        else:
            for e in range(cfg.num_experts):
                parts = expert_parts(cfg, layer, e)
                for name, t in (("gate", gate[e]), ("up", up[e]), ("down", down[e])):
                    out[parts[name].key] = t.contiguous()
    dst.mkdir(parents=True, exist_ok=True)
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((src / "config.json").read_text())
    raw.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


def run(path: Path, slots: int, tokens: int) -> dict:
    llm = LLM(path, dtype="float32", offload="host", cache_policy="lru", cache_experts=slots)
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    outs = [llm.generate([p], params)[0].token_ids for p in PROMPTS]  # batch 1
    s = llm.stats
    llm.close()
    return {"expert_format": s["expert_format"], "bytes_per_expert": s["bytes_per_expert"],
            "compute_bytes_per_expert": s["compute_bytes_per_expert"], "generated_tokens": s["generated_tokens"],
            "fetches": s["fetches"], "bytes_moved": s["bytes_moved"], "hit_rate": s["hit_rate"],
            "bytes_per_token": s["bytes_moved"] / s["generated_tokens"], "outputs": outs}


def best_of(fn, n: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def published(name: str, raw: dict) -> dict:
    cfg = read_config(raw)
    shape = ExpertShape.of(cfg)
    native, bf16 = Native(shape), Plain(shape, torch.bfloat16)
    per_token = cfg.top_k * len(cfg.moe_layers)
    g = torch.Generator().manual_seed(0)
    src = torch.randint(0, 256, (native.stored_bytes,), generator=g, dtype=torch.uint8)
    if shape.stored.method == "mxfp4":  # e8m0 scales in a sane range: set every scale byte to 2^-6
        for t, off in zip(native.layout.tensors, native.offsets):
            if t.dtype == torch.uint8 and len(t.shape) == 2:
                src[off:off + t.nbytes] = 121
            elif t.dtype == torch.bfloat16:
                src[off:off + t.nbytes].view(torch.bfloat16).normal_(0, 0.1, generator=g)
    else:  # fp8 bytes with NaN patterns cleared, scales 1e-3
        for t, off in zip(native.layout.tensors, native.offsets):
            seg = src[off:off + t.nbytes]
            if t.dtype == torch.float32:
                seg.view(torch.float32).fill_(1e-3)
            else:
                seg[(seg & 0x7F) == 0x7F] = 0
    out32 = torch.empty(shape.numel, dtype=torch.float32)
    bsrc = torch.randn(shape.numel, generator=g).to(torch.bfloat16).view(torch.uint8)
    decode_s = best_of(lambda: native.decode(src, out32))
    upcast_s = best_of(lambda: bf16.decode(bsrc, out32))
    assert torch.isfinite(out32).all()
    return {"model": name, "hidden_size": cfg.hidden_size, "expert_intermediate_size": cfg.expert_intermediate_size,
            "stored_format": native.name, "stored_bytes_per_expert": native.stored_bytes,
            "bf16_bytes_per_expert": bf16.stored_bytes, "ratio_vs_bf16": native.stored_bytes / bf16.stored_bytes,
            "cold_bytes_per_token": native.stored_bytes * per_token,
            "bf16_cold_bytes_per_token": bf16.stored_bytes * per_token,
            "decode_to_fp32_s": decode_s, "bf16_upcast_to_fp32_s": upcast_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--slots", type=int, default=3, help="LRU cache slots per MoE layer (of 8 experts)")
    ap.add_argument("--tokens", type=int, default=16, help="tokens generated per prompt")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "native_formats.json"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    tiny = []
    with tempfile.TemporaryDirectory() as tmp:
        for method, make in (("mxfp4", make_mxfp4_checkpoint), ("fp8-block", make_fp8_checkpoint)):
            q = make(Path(tmp) / method)
            b = bf16_copy(q, Path(tmp) / method / "dequantized-bf16")
            cfg = Checkpoint(q).config
            rq, rb = run(q, args.slots, args.tokens), run(b, args.slots, args.tokens)
            tiny.append({"model": f"tiny {cfg.model_type} (tests/formats/native.py)", "stored_format": method,
                         "hidden_size": cfg.hidden_size, "expert_intermediate_size": cfg.expert_intermediate_size,
                         "experts": cfg.num_experts, "top_k": cfg.top_k, "moe_layers": len(cfg.moe_layers),
                         "native": rq, "bf16": rb,
                         "bytes_per_expert_ratio": rq["bytes_per_expert"] / rb["bytes_per_expert"],
                         "bytes_per_token_ratio": rq["bytes_per_token"] / rb["bytes_per_token"],
                         "same_outputs": rq["outputs"] == rb["outputs"]})
            print(f"{method}: {rq['bytes_per_expert']} vs {rb['bytes_per_expert']} B/expert, "
                  f"{rq['bytes_per_token']:.0f} vs {rb['bytes_per_token']:.0f} B/token", flush=True)
    pub = [published(n, raw) for n, raw in PUBLISHED.items()]
    for p in pub:
        print(f"{p['model']}: {p['stored_bytes_per_expert']:,} vs {p['bf16_bytes_per_expert']:,} B/expert "
              f"({p['ratio_vs_bf16']:.3f}x), decode {p['decode_to_fp32_s'] * 1e3:.1f} ms vs upcast "
              f"{p['bf16_upcast_to_fp32_s'] * 1e3:.1f} ms", flush=True)
    res = {"command": "python benchmarks/native_formats.py " + " ".join(sys.argv[1:]), "provenance": provenance(),
           "settings": {"tier": "host", "cache_policy": "lru", "cache_slots_per_layer": args.slots, "batch": 1,
                        "tokens_per_prompt": args.tokens, "prompts": len(PROMPTS), "compute_dtype": "float32",
                        "threads": 1},
           "machine": {"cpu": cpu_model(), "torch": torch.__version__, "python": platform.python_version()},
           "tiny": tiny, "published_shapes": pub}
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
