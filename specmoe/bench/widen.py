"""A function-preserving *widened* copy of a checkpoint, so experts weigh megabytes as in
real MoE models while the outputs stay those of the small model.

Hidden size D → D' and expert width I → I' are padded with zeros (Net2Net-style
function-preserving growth, zero-padding variant):

- embeddings, lm_head, q/k/v (input side), router, experts, shared expert: zero columns
  for the new hidden coordinates; o_proj and every down projection: zero rows, so the
  residual stream's extra coordinates stay exactly 0 through the network;
- expert gate/up get zero rows and down zero columns for the new intermediate units:
  silu(0) · 0 = 0, so they add nothing;
- RMSNorm averages x² over D' instead of D: mean' = (D/D')·mean. With
  eps' = eps·D/D' the normaliser becomes rsqrt((D/D')(mean + eps)) = sqrt(D'/D)·rsqrt(mean + eps),
  so the norm weights are scaled by sqrt(D/D') on the original coordinates (zero on the
  pads). With D'/D a power of 4 that scale is a power of 2: exact in bf16.
- heads and head_dim are unchanged (Qwen3's q_norm/k_norm act per head and are untouched).

The copy is built on demand into a cache directory and never committed.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

SHARD_BYTES = 1 << 30
COPY_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")

# (pattern, rule); rules: "hid1" pad dim 1 to D', "hid0" pad dim 0 to D', "norm" scale+pad,
# "keep", "exp_in" [I, D] → [I', D'], "exp_out" [D, I] → [D', I']
RULES = (
    (r"(^|\.)embed_tokens\.weight$", "hid1"),
    (r"^lm_head\.weight$", "hid1"),
    (r"(^model\.norm|layernorm)\.weight$", "norm"),
    (r"self_attn\.(q|k|v)_proj\.weight$", "hid1"),
    (r"self_attn\.(q|k|v)_proj\.bias$", "keep"),
    (r"self_attn\.o_proj\.weight$", "hid0"),
    (r"self_attn\.(q|k)_norm\.weight$", "keep"),
    (r"\.experts\.\d+\.(gate_proj|up_proj|w1|w3)\.weight$", "exp_in"),
    (r"\.experts\.\d+\.(down_proj|w2)\.weight$", "exp_out"),
    (r"\.(mlp|block_sparse_moe)\.gate\.weight$", "hid1"),
    (r"shared_expert\.(gate_proj|up_proj)\.weight$", "hid1"),
    (r"shared_expert\.down_proj\.weight$", "hid0"),
    (r"shared_expert_gate\.weight$", "hid1"),
    (r"\.mlp\.(gate_proj|up_proj)\.weight$", "hid1"),
    (r"\.mlp\.down_proj\.weight$", "hid0"),
    (r"rotary_emb\.inv_freq$", "keep"),
)


def rule_of(key: str) -> str:
    for pat, rule in RULES:
        if re.search(pat, key):
            return rule
    raise ValueError(f"widen: no rule for tensor {key!r}; refusing to guess")


def _pad(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    out = torch.zeros(shape, dtype=t.dtype)
    out[tuple(slice(0, s) for s in t.shape)] = t
    return out


def widen_tensor(key: str, t: torch.Tensor, *, D: int, D2: int, I: int, I2: int) -> torch.Tensor:
    rule = rule_of(key)
    if rule == "keep":
        return t
    if rule == "hid1":
        assert t.shape[1] == D, f"{key}: expected hidden {D} on dim 1, got {tuple(t.shape)}"
        return _pad(t, (t.shape[0], D2))
    if rule == "hid0":
        assert t.shape[0] == D, f"{key}: expected hidden {D} on dim 0, got {tuple(t.shape)}"
        return _pad(t, (D2, *t.shape[1:]))
    if rule == "norm":
        assert t.shape == (D,), f"{key}: expected [{D}], got {tuple(t.shape)}"
        return _pad((t.float() * math.sqrt(D / D2)).to(t.dtype), (D2,))
    if rule == "exp_in":
        assert t.shape == (I, D), f"{key}: expected [{I}, {D}], got {tuple(t.shape)}"
        return _pad(t, (I2, D2))
    if rule == "exp_out":
        assert t.shape == (D, I), f"{key}: expected [{D}, {I}], got {tuple(t.shape)}"
        return _pad(t, (D2, I2))
    raise AssertionError(rule)


def _expert_inter_key(raw: dict) -> str:
    return "moe_intermediate_size" if "moe_intermediate_size" in raw else "intermediate_size"


def widen_checkpoint(src: str | Path, dst: str | Path, *, hidden: int, expert_intermediate: int,
                     progress: bool = False) -> dict:
    """Write the widened copy of `src` into `dst` (created). Returns a description."""
    from tqdm import tqdm
    src, dst = Path(src), Path(dst)
    raw = json.loads((src / "config.json").read_text())
    D, ikey = raw["hidden_size"], _expert_inter_key(raw)
    I = raw[ikey]
    D2, I2 = hidden, expert_intermediate
    assert D2 >= D and I2 >= I, "widening can only grow the model"
    head_dim = raw.get("head_dim") or D // raw["num_attention_heads"]
    files = sorted(src.glob("*.safetensors"))
    assert files, f"no safetensors files in {src}"
    dst.mkdir(parents=True, exist_ok=True)
    weight_map, shard, shard_bytes, shards = {}, {}, 0, []

    def flush():
        nonlocal shard, shard_bytes
        if shard:
            name = f"model-{len(shards) + 1:05d}.safetensors"
            save_file(shard, str(dst / name), metadata={"format": "pt"})
            shards.append(name)
            for k in shard:
                weight_map[k] = name
            shard, shard_bytes = {}, 0

    keys = [(f, k) for f in files for k in safe_open(str(f), framework="pt").keys()]
    for f, k in tqdm(keys, desc="widen", unit="tensor", disable=not progress, leave=False):
        with safe_open(str(f), framework="pt") as h:
            t = widen_tensor(k, h.get_tensor(k), D=D, D2=D2, I=I, I2=I2)
        shard[k] = t.contiguous()
        shard_bytes += t.numel() * t.element_size()
        if shard_bytes >= SHARD_BYTES:
            flush()
    flush()
    # final names: model-0000i-of-0000n.safetensors
    n = len(shards)
    for i, name in enumerate(shards):
        final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        (dst / name).rename(dst / final)
        for k, v in list(weight_map.items()):
            if v == name:
                weight_map[k] = final
    total = sum((dst / v).stat().st_size for v in set(weight_map.values()))
    (dst / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=1))
    cfg = dict(raw)
    cfg.update({"hidden_size": D2, ikey: I2, "head_dim": head_dim,
                "rms_norm_eps": raw.get("rms_norm_eps", 1e-6) * D / D2,
                "specmoe_widened_from": {"hidden_size": D, ikey: I, "rms_norm_eps": raw.get("rms_norm_eps", 1e-6)}})
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    for name in COPY_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    return {"source": str(src), "hidden": [D, D2], "expert_intermediate": [I, I2], "bytes": total,
            "rms_norm_eps": [cfg["specmoe_widened_from"]["rms_norm_eps"], cfg["rms_norm_eps"]]}


def default_size(src: str | Path, *, hidden: int | None = None, expert_mb: float = 6.0) -> tuple[int, int]:
    """D' = 4·D (the norm scale is then exactly 1/2) unless given; I' so one expert ≈ expert_mb MiB."""
    raw = json.loads((Path(src) / "config.json").read_text())
    D = raw["hidden_size"]
    D2 = hidden or 4 * D
    esize = {"float32": 4}.get(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16", 2)
    I2 = max(raw[_expert_inter_key(raw)], int(round(expert_mb * 2**20 / (3 * D2 * esize) / 64)) * 64)
    return D2, I2


def greedy_check(src: Path, dst: Path, *, dtype: str, prompts: list[list[int]], max_tokens: int,
                 device: str = "cpu") -> dict:
    """Greedy tokens of the widened copy vs the source under specmoe, with all experts resident."""
    from specmoe import LLM, SamplingParams
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    a = [o.token_ids for o in LLM(src, dtype=dtype, device=device, max_batch=len(prompts)).generate(prompts, sp)]
    b = [o.token_ids for o in LLM(dst, dtype=dtype, device=device, max_batch=len(prompts)).generate(prompts, sp)]
    same = sum(x == y for x, y in zip(a, b))
    return {"dtype": dtype, "sequences": len(a), "identical_sequences": same,
            "identical_tokens": sum(sum(p == q for p, q in zip(x, y)) for x, y in zip(a, b)),
            "tokens": sum(len(x) for x in a)}


def widened_copy(src: str | Path, *, cache_dir: str | Path, hidden: int | None = None, expert_mb: float = 6.0,
                 check_prompts: list[list[int]] | None = None, progress: bool = True,
                 device: str = "cpu") -> tuple[Path, dict]:
    """The widened copy of `src` under `cache_dir` (built once, reused while the source is unchanged),
    with a greedy equivalence check recorded on build."""
    from specmoe.weights.checkpoint import Checkpoint
    src = Path(src)
    D2, I2 = default_size(src, hidden=hidden, expert_mb=expert_mb)
    tag = hashlib.sha1(Checkpoint(src).fingerprint().encode()).hexdigest()[:10]
    dst = Path(cache_dir) / f"{src.name}-widened-d{D2}-i{I2}-{tag}"
    marker = dst / "widen.json"
    if marker.is_file():
        return dst, json.loads(marker.read_text())
    if dst.exists():
        shutil.rmtree(dst)  # an interrupted build
    t0 = time.perf_counter()
    info = widen_checkpoint(src, dst, hidden=D2, expert_intermediate=I2, progress=progress)
    info["build_s"] = time.perf_counter() - t0
    info["expert_bytes"] = Checkpoint(dst).config.expert_numel * (2 if "16" in Checkpoint(dst).config.dtype else 4)
    prompts = check_prompts or [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12]]
    info["greedy_check"] = [greedy_check(src, dst, dtype=d, prompts=prompts, max_tokens=16, device=device)
                            for d in ("float32", "bfloat16")]
    marker.write_text(json.dumps(info, indent=1))
    return dst, info
