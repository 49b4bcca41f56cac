"""Lazy, validated access to a Hugging Face safetensors checkpoint directory.

`Checkpoint` maps tensor names to files (single file or sharded index), opens files
lazily with `safe_open`, checks every key exists with the shape the config implies,
and reads one tensor at a time, so a checkpoint is never materialised whole.
"""
from __future__ import annotations

import hashlib
import json
import os
import warnings
from pathlib import Path

import torch
from safetensors import safe_open

from specmoe.config import read_json_object, type_name
from specmoe.errors import CheckpointError, InputError, UnsupportedModelError
from specmoe.families import load_config
from specmoe.weights.names import (ExpertPart, expert_parts, expert_tensors_per_layer, is_ignored, non_expert_keys,
                                   stored_tensors, stores_fused_experts)
from specmoe.weights.quantized import (assemble, cut, dequantize_fp8_blocks, dequantize_part, part_shape,
                                       stored_layout)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "half": torch.float16, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16}


# safetensors dtype codes a weight may have (integers, bools and fp8 are read only as a quantized checkpoint's)
FLOAT_CODES = {"F32", "F16", "BF16", "F64"}
FP8_CODE = "F8_E4M3"


def resolve_dtype(dtype: str | torch.dtype | None, default: str = "float32", device: torch.device | str | None = None
                  ) -> torch.dtype:
    """The compute dtype for LLM(dtype=...): a name, a floating torch.dtype, or "auto": the checkpoint's
    (`default`) on CUDA and wherever it is fp32; on a CPU, a half-precision checkpoint computes in its own
    dtype only if this CPU's half matmul is not slower than fp32 (a cached micro-benchmark,
    weights/autodtype.py), else in fp32. Expert weights keep the checkpoint's dtype in their tiers either way."""
    if isinstance(dtype, torch.dtype):
        if dtype not in DTYPES.values():
            raise InputError(f"dtype={dtype} is not a supported compute dtype; use float32, float16 or bfloat16")
        return dtype
    if dtype is not None and not isinstance(dtype, str):
        raise InputError(f"dtype must be a string or a torch.dtype, got {type(dtype).__name__}")
    name = (dtype or default)
    if name == "auto":
        name = default
        if device is not None and torch.device(device).type == "cpu" and DTYPES.get(name) in (torch.bfloat16,
                                                                                             torch.float16):
            from specmoe.weights.autodtype import half_matmul_is_fast
            if not half_matmul_is_fast(DTYPES[name]):
                name = "float32"
    if name not in DTYPES:
        raise InputError(f"dtype={name!r} is not supported; use one of auto, float32, float16, bfloat16")
    return DTYPES[name]


class Checkpoint:
    """A checkpoint directory: config + key → file map + lazy tensor reads."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.config = load_config(self.path)
        self.layout = stored_layout(self.config)  # how one expert is stored (None: floating point)
        self._handles: dict[str, object] = {}
        self._headers: dict[str, dict] = {}
        self.key_to_file = self._index()
        self.config.fused_experts = stores_fused_experts(self.config, self.key_to_file)
        if self.config.fused_experts and self.config.quantization is not None:
            raise UnsupportedModelError(f"{self.path}: quantized experts in the fused gate_up_proj / down_proj "
                                        "layout are not supported yet (per-expert quantized tensors are)")
        self.validate()

    def _index(self) -> dict[str, str]:
        index = self.path / "model.safetensors.index.json"
        single = self.path / "model.safetensors"
        if index.is_file():
            return self._read_index(index)
        files = sorted(self.path.glob("*.safetensors"))
        if single.is_file():
            files = [single]
        if not files:
            pickles = [p.name for p in self.path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt")]
            if pickles:
                raise CheckpointError(
                    f"{self.path} holds only pickle checkpoints ({', '.join(sorted(pickles)[:3])}); specmoe reads "
                    "safetensors only (pickle files can execute code). Convert with "
                    "`model.save_pretrained(dir, safe_serialization=True)`.")
            raise CheckpointError(f"no model.safetensors or model.safetensors.index.json in {self.path}")
        out = {}
        for f in files:
            for k in self._open(f.name).keys():
                out[k] = f.name
        return out

    def _read_index(self, index: Path) -> dict[str, str]:
        """weight_map of a sharded index: tensor name -> a .safetensors file in this directory."""
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"{index}: weight_map must be a non-empty object of tensor name -> shard file, "
                                  f"got {type_name(weight_map)}")
        for key, shard in weight_map.items():
            if (not isinstance(shard, str) or Path(shard).name != shard or shard in (".", "..")
                    or not shard.endswith(".safetensors")):
                raise CheckpointError(f"{index}: weight_map[{key!r}] must be a .safetensors file name in "
                                      f"{self.path}, got {shard!r}")
        for shard in sorted(set(weight_map.values())):
            if not (self.path / shard).is_file():
                raise CheckpointError(f"missing shard {shard} listed in {index.name} ({self.path})")
        return dict(weight_map)

    def _open(self, fname: str):
        h = self._handles.get(fname)
        if h is None:
            fpath = self.path / fname
            try:
                h = safe_open(str(fpath), framework="pt")
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise CheckpointError(f"cannot read {fpath}: corrupt or truncated safetensors file ({e})") from None
            self._handles[fname] = h
        return h

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._open(self.key_to_file[key]).get_slice(key).get_shape())

    def dtype_code(self, key: str) -> str:
        """The safetensors dtype code of a tensor (F32, BF16, U8, F8_E4M3, ...)."""
        return self._header(self.key_to_file[key])["tensors"][key].get("dtype")

    def scale_key(self, key: str) -> str | None:
        """The block scales of a non-expert weight an FP8 checkpoint stores in float8 (None: a float tensor)."""
        q = self.config.quantization
        if q is None or q.method != "fp8" or not key.endswith(".weight") or self.dtype_code(key) != FP8_CODE:
            return None
        return key + "_scale_inv"

    def expected_keys(self) -> dict[str, tuple[tuple[int, ...], set[str]]]:
        """{key: (shape, dtype codes it may have)} of every tensor the model reads."""
        cfg, q = self.config, self.config.quantization
        out = {key: (shape, FLOAT_CODES) for key, shape in non_expert_keys(cfg).values()}
        if q is not None and q.method == "fp8":  # any 2-D non-expert weight may be float8 with its block scales
            br, bc = q.block
            for key, (shape, _) in list(out.items()):
                if len(shape) == 2 and key.endswith(".weight"):
                    out[key] = (shape, FLOAT_CODES | {FP8_CODE})
                    if key in self.key_to_file and self.scale_key(key):
                        out[key + "_scale_inv"] = ((-(-shape[0] // br), -(-shape[1] // bc)), FLOAT_CODES)
        weight = {"mxfp4": {"U8"}, "fp8": {FP8_CODE}}.get(q.method) if q is not None else FLOAT_CODES
        scale = {"mxfp4": {"U8"}, "fp8": FLOAT_CODES}.get(q.method) if q is not None else set()
        for layer in cfg.moe_layers:
            for e in range(cfg.num_experts):
                for p in expert_parts(cfg, layer, e).values():
                    out[p.key] = (p.tensor_shape, weight if p.scale else FLOAT_CODES)
                    if p.scale:
                        out[p.scale] = (p.scale_shape, scale)
        return out

    def validate(self) -> None:
        """Every expected key present with its shape; unexpected keys reported by name."""
        cfg, n = self.config, len(self.key_to_file)
        if 4 * cfg.num_layers + expert_tensors_per_layer(cfg) * len(cfg.moe_layers) > n:  # before listing them all
            raise CheckpointError(f"checkpoint {self.path} holds {n} tensors, too few for the {cfg.num_layers} "
                                  f"layers x {cfg.num_experts} experts that config.json declares")
        expected = self.expected_keys()
        missing = [k for k in expected if k not in self.key_to_file]
        if missing:
            more = f" (+{len(missing) - 5} more)" if len(missing) > 5 else ""
            raise CheckpointError(f"checkpoint {self.path} is missing {len(missing)} tensor(s): "
                                  f"{', '.join(missing[:5])}{more}")
        unexpected = [k for k in self.key_to_file if k not in expected and not is_ignored(cfg, k)]
        head = cfg.head_prefix + "lm_head.weight"
        if self.config.tie_word_embeddings and head in unexpected:
            unexpected.remove(head)
        if unexpected:
            more = f" (+{len(unexpected) - 5} more)" if len(unexpected) > 5 else ""
            hint = ""
            if cfg.quantization is None and any(k.endswith(("_scale_inv", "_blocks", "_scales")) for k in unexpected):
                hint = ("; these are a quantized checkpoint's tensors: its config.json must declare "
                        "quantization_config (quant_method \"fp8\" or \"mxfp4\")")
            raise CheckpointError(f"checkpoint {self.path} has {len(unexpected)} unexpected tensor(s) for "
                                  f"{self.config.model_type}: {', '.join(unexpected[:5])}{more}{hint}")
        skipped = [k for k in self.key_to_file if k.startswith(cfg.skipped_prefixes)] if cfg.skipped_prefixes else []
        if skipped:
            under = [p for p in cfg.skipped_prefixes if any(k.startswith(p) for k in skipped)]
            warnings.warn(f"{self.path}: {len(skipped)} tensors under {', '.join(under)} (parts specmoe does not run: "
                          "a multimodal release's vision tower and projector, a multi-token-prediction module) are "
                          "not loaded; specmoe runs its language model", stacklevel=3)
        q = self.config.quantization
        for k, (_, codes) in expected.items():  # the shard map names the right file, and every dtype is expected
            fname = self.key_to_file[k]
            if fname not in self._handles:
                self._open(fname)  # safetensors validates the header before we read it
            tensors = self._header(fname)["tensors"]
            if k not in tensors:
                raise CheckpointError(f"model.safetensors.index.json maps {k} to {fname}, which does not "
                                      f"contain it ({self.path})")
            code = tensors[k].get("dtype")
            if code not in codes:
                if codes == FLOAT_CODES:
                    want = "a floating dtype (F32, F16, BF16)"
                    if code == FP8_CODE and q is None:
                        want += "; an FP8 checkpoint declares quantization_config (quant_method \"fp8\")"
                else:
                    want = f"{' or '.join(sorted(codes))}, as a {q.method} checkpoint stores it"
                raise CheckpointError(f"tensor {k} in {fname} has dtype {code}; expected {want}")
        for k, (shape, _) in expected.items():
            got = self.shape(k)
            if got != tuple(shape):
                raise CheckpointError(f"tensor {k} has shape {list(got)}, expected {list(shape)} from config.json")
        for fname in set(self.key_to_file.values()):
            self._check_length(fname)

    def _check_length(self, fname: str) -> None:
        """A truncated file has a valid header but fewer data bytes than it declares."""
        fpath = self.path / fname
        hdr = self._header(fname)
        end = max((v["data_offsets"][1] for v in hdr["tensors"].values()), default=0)
        if os.path.getsize(fpath) < hdr["base"] + end:
            raise CheckpointError(f"{fpath} is truncated: {os.path.getsize(fpath)} bytes, header declares "
                                  f"{hdr['base'] + end}")

    def tensor_offsets(self, key: str) -> tuple[Path, int, int, str]:
        """(file, absolute byte offset, byte length, safetensors dtype) of one tensor, for direct reads."""
        fname = self.key_to_file[key]
        hdr = self._header(fname)
        info = hdr["tensors"][key]
        a, b = info["data_offsets"]
        return self.path / fname, hdr["base"] + a, b - a, info["dtype"]

    def _header(self, fname: str) -> dict:
        """Parsed safetensors header of one file (read once): {"base": data offset, "tensors": {...}}."""
        if fname not in self._headers:
            fpath = self.path / fname
            with open(fpath, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                try:
                    h = json.loads(f.read(n))
                except (json.JSONDecodeError, UnicodeDecodeError):
                    raise CheckpointError(f"cannot read {fpath}: corrupt safetensors header") from None
            h.pop("__metadata__", None)
            self._headers[fname] = {"base": 8 + n, "tensors": h}
        return self._headers[fname]

    def get(self, key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """One tensor; a float8 weight of an FP8 checkpoint dequantised with its block scales (into `dtype`,
        default the checkpoint's)."""
        t = self._open(self.key_to_file[key]).get_tensor(key)
        sk = self.scale_key(key)
        if sk is not None:
            return dequantize_fp8_blocks(t, self.get(sk), self.config.quantization.block, dtype or self.storage_dtype)
        return t.to(dtype) if dtype is not None and t.dtype != dtype else t

    @property
    def storage_dtype(self) -> torch.dtype:
        """The dtype the checkpoint declares for its weights (what its experts are stored and moved in)."""
        return DTYPES[self.config.dtype]

    def _row(self, key: str, expert: int | None) -> torch.Tensor:
        """A tensor, or (fused experts) only row `expert` of it."""
        sl = self._open(self.key_to_file[key]).get_slice(key)
        return sl[expert] if expert is not None else sl[:]

    def read_part(self, part: ExpertPart, dtype: torch.dtype | None = None) -> torch.Tensor:
        """One expert's part (see `ExpertPart`): of a fused tensor only that expert's row is read; a quantized part
        is dequantised (computed in fp32, rounded once to `dtype`; default fp32)."""
        t = self._row(part.key, part.expert)
        if part.scale is not None:
            lay = self.layout
            out = torch.empty(part_shape(lay.method, part, t), dtype=dtype or torch.float32)
            dequantize_part(lay.method, lay.block, part, t, self._row(part.scale, part.expert).to(lay.scale_dtype),
                            out)
            return out
        t = cut(part, t)
        return t.to(dtype) if dtype is not None and t.dtype != dtype else t

    def read_stored(self, layer: int, expert: int) -> list[torch.Tensor]:
        """One expert of a checkpoint that ships quantized experts, as stored: its row of each stored tensor, in
        the order and dtypes of `self.layout` (float tensors in the checkpoint's dtype, FP8 scales in fp32)."""
        if self.layout is None:
            raise InputError(f"{self.path} stores its experts in floating point; there are no quantized tensors")
        st = stored_tensors(expert_parts(self.config, layer, expert))
        return [self._row(key, row).to(spec.dtype).contiguous()
                for (key, row, _, _), spec in zip(st, self.layout.tensors)]

    def read_expert(self, layer: int, expert: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """One expert packed as a contiguous flat buffer [gate (I·D); up (I·D); down (D·I)] (+ with expert
        biases [gate bias (I); up bias (I); down bias (D)]), whatever the checkpoint's layout, in `dtype`
        (default: the checkpoint's `storage_dtype`). Quantized experts are dequantised from their stored tensors
        (`weights.quantized.assemble`, as the expert formats decode them on arrival in a slot)."""
        dtype = dtype or self.storage_dtype
        if self.layout is not None:
            out = torch.empty(self.config.expert_numel, dtype=dtype)
            assemble(self.layout, self.read_stored(layer, expert), out)
            return out
        parts = expert_parts(self.config, layer, expert)
        return torch.cat([self.read_part(p, dtype).reshape(-1) for p in parts.values()])

    def fingerprint(self) -> str:
        """Cheap identity of the weight files: names, sizes and mtimes (for caches next to the checkpoint)."""
        parts = []
        for fname in sorted(set(self.key_to_file.values())):
            st = os.stat(self.path / fname)
            parts.append(f"{fname}:{st.st_size}:{st.st_mtime_ns}")
        return "|".join(parts)

    def content_fingerprint(self, known: dict | None = None) -> dict[str, dict]:
        """Identity of the weight files by content: {file name: {"size", "mtime_ns", "sha256"}}.

        A file whose size and mtime equal its entry in `known` (a previous result) keeps that entry's
        digest without being read; any other file is hashed in full. So a file that was only touched
        (new mtime, same bytes) keeps its digest, and a changed file gets a new one."""
        out = {}
        for fname in sorted(set(self.key_to_file.values())):
            fpath = self.path / fname
            st = os.stat(fpath)
            prev = (known or {}).get(fname)
            if isinstance(prev, dict) and prev.get("size") == st.st_size and prev.get("mtime_ns") == st.st_mtime_ns \
                    and isinstance(prev.get("sha256"), str):
                digest = prev["sha256"]
            else:
                h = hashlib.sha256()
                with open(fpath, "rb") as f:
                    while chunk := f.read(1 << 23):
                        h.update(chunk)
                digest = h.hexdigest()
            out[fname] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest}
        return out
