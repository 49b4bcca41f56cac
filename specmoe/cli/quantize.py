"""`specmoe quantize [MODEL] --format int8|int4 [--group-size 32|64]`: write the checkpoint's experts, quantized,
into the expert repack (once; `expert_format=` then reads them from there)."""
from __future__ import annotations

from pathlib import Path

from specmoe.cli.common import print_json
from specmoe.errors import InputError


def register(sub) -> None:
    p = sub.add_parser("quantize", help="quantize a checkpoint's experts (int8 / int4) into the expert repack")
    p.add_argument("model", nargs="?", default=None, help="checkpoint directory (default: the demo model)")
    p.add_argument("--format", required=True, choices=("int8", "int4"), help="int8: per output channel scales; "
                   "int4: two weights per byte, one scale per group")
    p.add_argument("--group-size", type=int, default=None, choices=(32, 64), help="int4 group size (default 32)")
    p.add_argument("--repack-dir", default=None, help="where the repack goes (default: <checkpoint>/.specmoe, "
                   "else ~/.cache/specmoe/<hash>); pass the same repack_dir when loading")
    p.add_argument("--json", action="store_true", help="print as JSON")
    p.set_defaults(func=run)


def format_name(fmt: str, group_size: int | None) -> str:
    if fmt == "int8":
        if group_size is not None:
            raise InputError("--group-size is for --format int4 (int8 has one scale per output channel)")
        return "int8"
    return f"int4-g{group_size or 32}"


def quantize(model, fmt: str, repack_dir=None, *, progress: bool = False) -> dict:
    """Quantize (or find, validated) the repack of `model`'s experts in `fmt`; returns what was written."""
    from specmoe.engine.llm import default_model_path
    from specmoe.experts.formats import ExpertShape, Plain, make_format
    from specmoe.experts.repack import find_repack, open_repack
    from specmoe.weights.checkpoint import Checkpoint
    ck = Checkpoint(Path(model) if model else default_model_path())
    f = make_format(fmt, ExpertShape.of(ck.config), ck.storage_dtype)
    existed = find_repack(ck, f, repack_dir) is not None
    rp = open_repack(ck, f, repack_dir, progress=progress)
    plain = Plain(f.shape, ck.storage_dtype)
    n = len(rp.moe_layers) * rp.num_experts
    return {"checkpoint": str(ck.path), "expert_format": f.name, "file": str(rp.file), "manifest": str(rp.manifest),
            "already_existed": existed, "experts": n, "bytes_per_expert": rp.expert_bytes,
            "checkpoint_bytes_per_expert": plain.stored_bytes, "checkpoint_dtype": plain.name,
            "ratio": rp.expert_bytes / plain.stored_bytes, "file_bytes": n * rp.stride}


def run(args) -> int:
    info = quantize(args.model, format_name(args.format, args.group_size), args.repack_dir, progress=True)
    if args.json:
        print_json(info)
        return 0
    print(f"{'found' if info['already_existed'] else 'wrote'} {info['expert_format']} experts of "
          f"{info['checkpoint']}: {info['file']}")
    print(f"  {info['bytes_per_expert']:,} bytes per expert ({info['ratio']:.3f}x the checkpoint's "
          f"{info['checkpoint_dtype']} {info['checkpoint_bytes_per_expert']:,}); load with "
          f"expert_format='{info['expert_format']}'" + (f", repack_dir='{args.repack_dir}'" if args.repack_dir else ""))
    return 0
