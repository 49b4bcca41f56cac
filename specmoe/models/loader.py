"""Build the decoder (or the encoder–decoder model) on `meta` and assign its non-expert weights from a checkpoint,
one tensor at a time (never the whole checkpoint in memory)."""
from __future__ import annotations

import torch
from torch import nn
from tqdm import tqdm

from specmoe import kernels as native
from specmoe.models import orientation
from specmoe.models.decoder import Transformer
from specmoe.models.rowclasses import deterministic_rows
from specmoe.models.seq2seq import Seq2SeqModel
from specmoe.weights.checkpoint import Checkpoint
from specmoe.weights.names import fp32_params, non_expert_keys


def load_model(ckpt: Checkpoint, *, dtype: torch.dtype, device: torch.device | str = "cpu",
               progress: bool = False) -> Transformer | Seq2SeqModel:
    cfg = ckpt.config
    with torch.device("meta"):
        model = Seq2SeqModel(cfg) if cfg.seq2seq is not None else Transformer(cfg)
    names = non_expert_keys(cfg)
    keep_fp32 = fp32_params(cfg)
    for pname, (key, shape) in tqdm(names.items(), desc="weights", unit="t", disable=not progress, leave=False):
        t = ckpt.get(key, torch.float32 if pname in keep_fp32 else dtype).to(device)
        assert tuple(t.shape) == tuple(shape), f"{key}: shape {tuple(t.shape)} != {shape}"
        mod_name, attr = pname.rsplit(".", 1)
        setattr(model.get_submodule(mod_name), attr, nn.Parameter(t, requires_grad=False))
    leftover = [n for n, p in model.named_parameters() if p.is_meta]
    assert not leftover, f"parameters never assigned: {leftover}"
    if cfg.attention_sinks and dtype == torch.float32:
        # fp32 attention with sinks pads its query rows to this machine's row classes: measure them now (once per
        # machine, ~2 s, then cached), not inside the first forward
        deterministic_rows()
    orientation.prepare(dtype, device)  # which way round this CPU computes a few rows' projections (cached)
    model = model.fuse().eval()
    stored = stored_dtype(ckpt.storage_dtype, dtype, torch.device(device))
    q = cfg.quantization
    if stored is not None and isinstance(model, Transformer) and (q is None or q.method != "fp8"):
        # (FP8 weights are dequantised at load: their values are not the storage dtype's)
        model.keep_stored(stored)
    return model


def stored_dtype(storage: torch.dtype, compute: torch.dtype, device: torch.device) -> torch.dtype | None:
    """The dtype a model computing in `compute` keeps its projections in: the checkpoint's `storage` dtype (bf16 /
    fp16) where it differs from fp32 compute on a CPU with the native kernels (no fp32 copy: half the bytes read per
    token); None (the compute dtype) elsewhere."""
    if device.type == "cpu" and compute == torch.float32 and storage in (torch.bfloat16, torch.float16) \
            and native.available():
        return storage
    return None
