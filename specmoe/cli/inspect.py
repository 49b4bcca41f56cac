"""`specmoe inspect PATH`: what a checkpoint is and where its bytes are."""
from __future__ import annotations

from pathlib import Path

from specmoe import kernels as native
from specmoe.cli.common import print_json
from specmoe.config import read_json_object
from specmoe.errors import CheckpointError
from specmoe.experts.profiling import load_profile, skewness


def register(sub) -> None:
    p = sub.add_parser("inspect", help="describe a checkpoint: family, layers, experts, bytes")
    p.add_argument("path", nargs="?", default=None, help="checkpoint directory (default: the demo model)")
    p.add_argument("--json", action="store_true", help="print as JSON")
    p.set_defaults(func=run)


def describe(path) -> dict:
    from specmoe.engine.llm import default_model_path
    from specmoe.weights.checkpoint import Checkpoint
    from specmoe.weights.names import expert_parts, non_expert_keys, stored_tensors
    path = Path(path) if path else default_model_path()
    ck = Checkpoint(path)
    cfg = ck.config

    def nbytes(key):
        _, _, n, _ = ck.tensor_offsets(key)
        return n
    expert_bytes = sum(nbytes(k) for k in {t[0] for layer in cfg.moe_layers for e in range(cfg.num_experts)
                                            for t in stored_tensors(expert_parts(cfg, layer, e))})
    other = sum(nbytes(k) + (nbytes(ck.scale_key(k)) if ck.scale_key(k) else 0)
                for k, _ in non_expert_keys(cfg).values())
    info = {"path": str(path), "family": cfg.model_type, "layers": cfg.num_layers,
            "moe_layers": len(cfg.moe_layers), "experts_per_layer": cfg.num_experts, "top_k": cfg.top_k,
            "hidden_size": cfg.hidden_size, "expert_intermediate_size": cfg.expert_intermediate_size,
            "attention": "mla" if cfg.mla else ("sinks" if cfg.attention_sinks else
                                                 "hybrid" if cfg.linear_layers else "gqa"),
            "linear_attention_layers": len(cfg.linear_layers),
            "not_loaded": ", ".join(f"{p}*" for p in cfg.skipped_prefixes) or None,  # vision tower, MTP weights
            "shared_experts": bool(cfg.shared_expert_intermediate_size),
            "dense_layers": cfg.num_layers - len(cfg.moe_layers),
            "rope": "yarn" if cfg.yarn else ("llama3" if cfg.llama3_rope else "default"),
            "layer_kinds": layer_kinds(cfg),
            "vocab_size": cfg.vocab_size, "context_length": cfg.max_position_embeddings, "dtype": cfg.dtype,
            "quantization": cfg.quantization.method if cfg.quantization else None,
            "kernels": native.path(),  # the CPU matmul path: native-avx2 / native-avx512, or torch
            "expert_bytes": expert_bytes, "non_expert_bytes": other,
            "bytes_per_expert": expert_bytes // max(1, len(cfg.moe_layers) * cfg.num_experts)}
    if cfg.seq2seq is not None:  # encoder–decoder: each stack's layers and their kinds
        Le = cfg.seq2seq.encoder_layers
        kinds = ["moe" if cfg.is_moe_layer(i) else "dense" for i in range(Le + cfg.num_layers)]
        info.update(layers=Le + cfg.num_layers, dense_layers=kinds.count("dense"), attention="mha+cross",
                    rope="sinusoidal", encoder_layers=", ".join(kinds[:Le]), decoder_layers=", ".join(kinds[Le:]))
    info["expert_formats"] = expert_formats(ck)
    prof = path / "expert_profile.json"
    if prof.is_file():
        read_json_object(prof)  # not UTF-8 / not JSON / not an object: a CheckpointError naming the file
        try:
            counts = load_profile(prof, cfg)  # wrong structure or shape: a CheckpointError naming the file
        except (TypeError, ValueError):
            raise CheckpointError(f"expert profile {prof}: counts must be integers") from None
        info["skewness_per_layer"] = [round(skewness(row), 3) for row in counts]
    return info


def layer_kinds(cfg) -> list[str]:
    """Each layer's kind: "moe" or "dense", then how its token mixer differs from full causal rotary attention
    ("linear_attention": Gated DeltaNet, a recurrent state instead of attention; "nope": no rotary embeddings;
    "chunked N": local attention in chunks of N positions; "window N": a sliding window of N)."""
    out = []
    for i in range(cfg.num_layers):
        kind = ["moe" if cfg.is_moe_layer(i) else "dense"]
        if i in cfg.linear_layers:
            kind.append("linear_attention")
        else:
            if not cfg.rotary(i):
                kind.append("nope")
            if cfg.chunk(i):
                kind.append(f"chunked {cfg.chunk(i)}")
            if cfg.window(i):
                kind.append(f"window {cfg.window(i)}")
        out.append(" ".join(kind))
    return out


def runs(kinds: list[str]) -> str:
    """Layer kinds as text, runs of equal kinds written once with their layer range: "0-2: moe linear_attention,
    3: moe"."""
    out = []  # [first, last, kind]
    for i, k in enumerate(kinds):
        if out and out[-1][2] == k:
            out[-1][1] = i
        else:
            out.append([i, i, k])
    return ", ".join(f"{a}{f'-{b}' if b > a else ''}: {k}" for a, b, k in out)


def expert_formats(ck) -> list[dict]:
    """Each expert storage format: bytes per expert, and the bytes a token implies when every one of its
    routed experts is fetched (top-k per MoE layer, a cold cache: the upper bound a cache divides down). The
    ratio is against the expert in the checkpoint's float dtype (for a checkpoint that ships quantized experts,
    mxfp4 / fp8-block: what its dequantised model holds)."""
    from specmoe.experts.formats import ExpertShape, Plain, all_formats
    from specmoe.experts.repack import find_repack
    cfg = ck.config
    shape = ExpertShape.of(cfg)
    fmts = all_formats(shape, ck.storage_dtype)
    base = Plain(shape, ck.storage_dtype).stored_bytes
    per_token = cfg.top_k * len(cfg.moe_layers)
    return [{"expert_format": "checkpoint" if i == 0 else f.name, "storage": f.name,
             "bytes_per_expert": f.stored_bytes, "ratio": round(f.stored_bytes / base, 4),
             "bytes_per_token_cold": f.stored_bytes * per_token,
             "repacked": find_repack(ck, f) is not None} for i, f in enumerate(fmts)]


def run(args) -> int:
    info = describe(args.path)
    if args.json:
        print_json(info)
        return 0
    formats = info.pop("expert_formats")
    for k, v in info.items():
        if k == "layer_kinds":
            v = runs(v)
        if isinstance(v, int) and k.endswith("bytes"):
            v = f"{v:,} ({v / 2**20:.2f} MiB)"
        print(f"{k:>26}: {v}")
    print(f"{'expert formats':>26}: bytes per expert, and per token with every routed expert fetched "
          f"(top-k x MoE layers)")
    for f in formats:
        name = f["expert_format"] + (f" ({f['storage']})" if f["storage"] != f["expert_format"] else "")
        print(f"{name:>26}: {f['bytes_per_expert']:>12,} B/expert ({f['ratio']:.3f}x)  "
              f"{f['bytes_per_token_cold'] / 2**20:>9.2f} MiB/token" + ("  [repacked]" if f["repacked"] else ""))
    return 0
