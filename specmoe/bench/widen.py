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

So every hidden state of the copy (embeddings, residual stream, normed features) is the source's with
D' - D zeros appended. An EAGLE head (specmoe.models.eagle) reads exactly those (the target's token
embeddings and hidden states), so the head that ships for the source is widened the same way
(`widen_eagle_head`) into the copy's `eagle/` subdirectory, where the engine finds it
(`specmoe.bundled.default_eagle_head`): each D-wide input block of fc and of the attention's q/k/v gets
zero columns, fc / o_proj / down get zero rows, its RMSNorms are rescaled with the same eps rule, and
the head's output is the source head's with zeros appended, so its drafts equal the source head's.

The copy is built on demand into a cache directory and never committed. `sparse=True` writes its weight files
sparse (`save_sparse`: the zero runs are holes), so a copy far larger than the disk's free space fits; such a copy
is only read to build a repack or a GGUF (reads of holes cost no disk I/O, so it is never timed).
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import time
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from specmoe.bundled import EAGLE_SUBDIR  # the widened head's directory inside the copy (default_eagle_head)

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


# An EAGLE head's published keys (specmoe.models.eagle `_head_keys`); "blocks": the input dim is k blocks of D
# (fc: 2 (EAGLE-1: embedding, feature) or 3 (EAGLE-3: three target states); EAGLE-3's q/k/v: 2), each padded
# to D'; fc also gets zero rows (its output is the head's hidden width, D')
HEAD_RULES = (
    (r"^fc\.weight$", "fc"),
    (r"^fc\.bias$", "hid0"),
    (r"(layernorm|hidden_norm)\.weight$|^norm\.weight$", "norm"),
    (r"self_attn\.(q|k|v)_proj\.weight$", "blocks"),
    (r"self_attn\.(q|k|v)_proj\.bias$", "keep"),
    (r"self_attn\.o_proj\.(weight|bias)$", "hid0"),
    (r"mlp\.(gate_proj|up_proj)\.weight$", "hid1"),
    (r"mlp\.down_proj\.weight$", "hid0"),
    (r"^(lm_head|embed_tokens)\.weight$", "hid1"),
    (r"^(d2t|t2d)$", "keep"),
)


def rule_of(key: str, rules=RULES) -> str:
    for pat, rule in rules:
        if re.search(pat, key):
            return rule
    raise ValueError(f"widen: no rule for tensor {key!r}; refusing to guess")


def _pad(t: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    out = torch.zeros(shape, dtype=t.dtype)
    out[tuple(slice(0, s) for s in t.shape)] = t
    return out


def _pad_blocks(t: torch.Tensor, D: int, D2: int, rows: int | None = None) -> torch.Tensor:
    """[R, k·D] → [rows (default R), k·D']: block j's columns at j·D' .. j·D'+D-1, zeros elsewhere."""
    k = t.shape[1] // D
    out = torch.zeros((rows or t.shape[0], k * D2), dtype=t.dtype)
    for j in range(k):
        out[:t.shape[0], j * D2: j * D2 + D] = t[:, j * D:(j + 1) * D]
    return out


def widen_tensor(key: str, t: torch.Tensor, *, D: int, D2: int, I: int = 0, I2: int = 0,
                 rules=RULES) -> torch.Tensor:
    rule = rule_of(key, rules)
    if rule in ("fc", "blocks"):
        assert t.dim() == 2 and t.shape[1] % D == 0, f"{key}: expected [*, k·{D}], got {tuple(t.shape)}"
        if rule == "fc":
            assert t.shape[0] == D, f"{key}: expected {D} rows, got {tuple(t.shape)}"
        return _pad_blocks(t, D, D2, D2 if rule == "fc" else t.shape[0])
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


SPARSE_CHUNK = 1 << 16  # save_sparse skips all-zero runs of this many bytes (aligned within each tensor)
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64",
              torch.int32: "I32", torch.uint8: "U8", torch.int8: "I8", torch.bool: "BOOL", torch.float64: "F64"}


def save_sparse(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict | None = None) -> dict:
    """Write `tensors` as a safetensors file (the format `safetensors.torch.save_file` writes: an 8-byte header
    length, the JSON header padded to 8 bytes, the tensors' bytes back to back) whose all-zero runs of
    SPARSE_CHUNK bytes are left as holes: the file reads back exactly, but only its non-zero chunks take disk
    blocks. Returns {"apparent_bytes", "written_bytes"}."""
    import numpy as np
    keys = sorted(tensors)
    header: dict = {"__metadata__": dict(metadata)} if metadata else {}
    off = 0
    for k in keys:
        t = tensors[k]
        n = t.numel() * t.element_size()
        header[k] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + n]}
        off += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    base = 8 + len(head)
    written = 0
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.pwrite(fd, len(head).to_bytes(8, "little") + head, 0)
        for k in keys:
            t = tensors[k].contiguous()
            raw = t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)
            pos = base + header[k]["data_offsets"][0]
            full = len(raw) // SPARSE_CHUNK * SPARSE_CHUNK
            if full:
                nz = raw[:full].view(np.uint64).reshape(-1, SPARSE_CHUNK // 8).any(axis=1) if full % 8 == 0 \
                    else raw[:full].reshape(-1, SPARSE_CHUNK).any(axis=1)
                for i in np.flatnonzero(nz):
                    a = int(i) * SPARSE_CHUNK
                    written += os.pwrite(fd, raw[a:a + SPARSE_CHUNK], pos + a)
            if full < len(raw) and raw[full:].any():
                written += os.pwrite(fd, raw[full:], pos + full)
        os.ftruncate(fd, base + off)
    finally:
        os.close(fd)
    return {"apparent_bytes": base + off, "written_bytes": written + base}


def _expert_inter_key(raw: dict) -> str:
    return "moe_intermediate_size" if "moe_intermediate_size" in raw else "intermediate_size"


def widen_checkpoint(src: str | Path, dst: str | Path, *, hidden: int, expert_intermediate: int,
                     progress: bool = False, sparse: bool = False) -> dict:
    """Write the widened copy of `src` into `dst` (created); `sparse`: weight files with holes for their zero
    runs (`save_sparse`). Returns a description."""
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
    written = 0

    def flush():
        nonlocal shard, shard_bytes, written
        if shard:
            name = f"model-{len(shards) + 1:05d}.safetensors"
            if sparse:
                written += save_sparse(shard, dst / name, metadata={"format": "pt"})["written_bytes"]
            else:
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
    out = {"source": str(src), "hidden": [D, D2], "expert_intermediate": [I, I2], "bytes": total,
           "rms_norm_eps": [cfg["specmoe_widened_from"]["rms_norm_eps"], cfg["rms_norm_eps"]]}
    if sparse:
        out["sparse_written_bytes"] = written
    return out


def widen_eagle_head(src: str | Path, dst: str | Path, *, hidden: int) -> dict:
    """Write the widened copy of the EAGLE head directory `src` (EAGLE-1 or EAGLE-3, published layout) into `dst`
    for a target widened to `hidden`: config.json with the head's hidden size, eps and target_hidden_size
    rescaled, model.safetensors by `HEAD_RULES`, every other file (draft_vocab.safetensors,
    training_meta.json) copied as is (token ids do not change). Returns a description."""
    from specmoe.models.eagle import WEIGHTS
    src, dst = Path(src), Path(dst)
    raw = json.loads((src / "config.json").read_text())
    D, D2 = raw["hidden_size"], hidden
    if raw.get("target_hidden_size", D) != D:
        raise ValueError(f"{src}: a head whose hidden size ({D}) differs from its target's "
                         f"({raw['target_hidden_size']}) cannot read the target's embeddings; refusing to widen")
    assert D2 >= D, "widening can only grow the head"
    dst.mkdir(parents=True, exist_ok=True)
    with safe_open(str(src / WEIGHTS), framework="pt") as h:
        meta = h.metadata() or {"format": "pt"}
        out = {k: widen_tensor(k, h.get_tensor(k), D=D, D2=D2, rules=HEAD_RULES).contiguous() for k in h.keys()}
    save_file(out, str(dst / WEIGHTS), metadata=meta)
    eps = raw.get("rms_norm_eps", 1e-6)
    cfg = dict(raw)
    cfg.update({"hidden_size": D2, "rms_norm_eps": eps * D / D2,
                "head_dim": raw.get("head_dim") or D // raw["num_attention_heads"],
                "specmoe_widened_from": {"hidden_size": D, "rms_norm_eps": eps, "source": str(src)}})
    if "target_hidden_size" in raw:
        cfg["target_hidden_size"] = D2
    (dst / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    for f in src.iterdir():
        if f.is_file() and f.name not in ("config.json", WEIGHTS):
            shutil.copy2(f, dst / f.name)
    return {"source": str(src), "hidden": [D, D2], "rms_norm_eps": [eps, cfg["rms_norm_eps"]],
            "bytes": (dst / WEIGHTS).stat().st_size}


def eagle_head_check(src: str | Path, dst: str | Path, *, entries: int = 12, seed: int = 0) -> dict:
    """The widened head against its source on random inputs (fp32, a fresh cache): the source head's inputs with
    zeros appended to each D-wide block give the source head's output with zeros appended (EAGLE-3: also the
    same draft logits). Returns the largest absolute differences."""
    from specmoe.models.decoder import BatchView
    from specmoe.models.eagle import load_eagle_head
    a, b = load_eagle_head(src), load_eagle_head(dst)
    D, D2 = a.hc.hidden_size, b.hc.hidden_size
    F = a.hc.feature_layers * a.hc.target_hidden_size
    g = torch.Generator().manual_seed(seed)
    e, h = torch.randn(1, entries, D, generator=g), torch.randn(1, entries, F, generator=g)
    def wide(x):  # [1, T, k·D] → [1, T, k·D'], zeros appended to each block
        return _pad_blocks(x[0], D, D2)[None]

    def run(head, emb, feats):
        kv = head.new_cache(1, entries, torch.float32, "cpu")
        bv = BatchView(slots=torch.arange(1), positions=torch.arange(entries)[None], contiguous=slice(0, 1),
                       key_len=entries)
        return head(emb, feats, kv, bv)[0]
    with torch.inference_mode():
        x, y = run(a, e, h), run(b, wide(e), wide(h))
        out = {"max_abs_diff": float((y[:, :D] - x).abs().max()), "pad_max_abs": float(y[:, D:].abs().max()),
               "output_max_abs": float(x.abs().max())}
        if a.lm_head is not None:  # EAGLE-3: its own norm + lm_head score the draft vocabulary
            out["logits_max_abs_diff"] = float((b.draft_logits(y, None) - a.draft_logits(x, None)).abs().max())
    return out


def default_size(src: str | Path, *, hidden: int | None = None, expert_mb: float = 6.0) -> tuple[int, int]:
    """D' = 4·D (the norm scale is then exactly 1/2) unless given; I' so one expert ≈ expert_mb MiB."""
    raw = json.loads((Path(src) / "config.json").read_text())
    D = raw["hidden_size"]
    D2 = hidden or 4 * D
    esize = {"float32": 4}.get(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16", 2)
    I2 = max(raw[_expert_inter_key(raw)], int(round(expert_mb * 2**20 / (3 * D2 * esize) / 64)) * 64)
    return D2, I2


def greedy_check(src: Path, dst: Path, *, dtype: str, prompts: list[list[int]], max_tokens: int,
                 device: str = "cpu", options: dict | None = None) -> dict:
    """Greedy tokens of the widened copy vs the source under specmoe: the source with all experts resident, the
    copy likewise or with `options` (LLM options, e.g. a disk tier for a copy larger than memory)."""
    from specmoe import LLM, SamplingParams
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    a = [o.token_ids for o in LLM(src, dtype=dtype, device=device, max_batch=len(prompts)).generate(prompts, sp)]
    wide = LLM(dst, dtype=dtype, device=device, max_batch=len(prompts), **(options or {}))
    try:
        b = [o.token_ids for o in wide.generate(prompts, sp)]
    finally:
        wide.close()
    same = sum(x == y for x, y in zip(a, b))
    return {"dtype": dtype, "sequences": len(a), "identical_sequences": same, "options": options or {},
            "identical_tokens": sum(sum(p == q for p, q in zip(x, y)) for x, y in zip(a, b)),
            "tokens": sum(len(x) for x in a)}


def _widened_head(head: Path, dst: Path, D2: int) -> dict:
    """Widen `head` into `dst`/eagle (built aside, then moved in place) and check it (`eagle_head_check`)."""
    out, tmp = dst / EAGLE_SUBDIR, dst / f"{EAGLE_SUBDIR}.building"
    for d in (out, tmp):
        if d.exists():
            shutil.rmtree(d)
    info = widen_eagle_head(head, tmp, hidden=D2)
    tmp.rename(out)
    return {"path": EAGLE_SUBDIR, **info, "check": eagle_head_check(head, out)}


def widened_copy(src: str | Path, *, cache_dir: str | Path, hidden: int | None = None, expert_mb: float = 6.0,
                 check_prompts: list[list[int]] | None = None, progress: bool = True,
                 device: str = "cpu", eagle_head: str | Path | None = None, sparse: bool = False,
                 check_dtypes: tuple[str, ...] = ("float32", "bfloat16"),
                 check_options: dict | None = None) -> tuple[Path, dict]:
    """The widened copy of `src` under `cache_dir` (built once, reused while the source is unchanged),
    with a greedy equivalence check recorded on build (in `check_dtypes`, the copy run with `check_options`:
    see `greedy_check`). The EAGLE head `eagle_head` (default: the one that ships
    for `src`, `specmoe.bundled.default_eagle_head`; none: no head) is widened into the copy's `eagle/`, the
    head `drafter='eagle'` uses there by default; a cached copy without it (or with another source's) gets it.
    `sparse`: weight files with holes for their zero runs (`save_sparse`; the same bytes when read)."""
    from specmoe.bundled import default_eagle_head
    from specmoe.errors import SpecMoEError
    from specmoe.weights.checkpoint import Checkpoint
    src = Path(src)
    D2, I2 = default_size(src, hidden=hidden, expert_mb=expert_mb)
    tag = hashlib.sha1(Checkpoint(src).fingerprint().encode()).hexdigest()[:10]
    dst = Path(cache_dir) / f"{src.name}-widened-d{D2}-i{I2}-{tag}"
    marker = dst / "widen.json"
    if eagle_head is None:
        try:
            eagle_head = default_eagle_head(src)
        except SpecMoEError:  # the demo model's head is missing: a copy without one
            eagle_head = None
    head = Path(eagle_head).resolve() if eagle_head is not None else None
    if marker.is_file():
        info = json.loads(marker.read_text())
        have = info.get("eagle_head", {}).get("source")
        if head is not None and (have != str(head) or not (dst / EAGLE_SUBDIR / "config.json").is_file()):
            info["eagle_head"] = _widened_head(head, dst, D2)  # a copy built before heads were widened
            marker.write_text(json.dumps(info, indent=1))
        return dst, info
    if dst.exists():
        shutil.rmtree(dst)  # an interrupted build
    t0 = time.perf_counter()
    info = widen_checkpoint(src, dst, hidden=D2, expert_intermediate=I2, progress=progress, sparse=sparse)
    if head is not None:
        info["eagle_head"] = _widened_head(head, dst, D2)
    info["build_s"] = time.perf_counter() - t0
    info["expert_bytes"] = Checkpoint(dst).config.expert_numel * (2 if "16" in Checkpoint(dst).config.dtype else 4)
    prompts = check_prompts or [[1, 2, 3, 4, 5, 6, 7, 8], [9, 10, 11, 12]]
    info["greedy_check"] = [greedy_check(src, dst, dtype=d, prompts=prompts, max_tokens=16, device=device,
                                         options=check_options) for d in check_dtypes]
    marker.write_text(json.dumps(info, indent=1))
    return dst, info
