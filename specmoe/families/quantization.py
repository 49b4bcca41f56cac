"""`quantization_config` of config.json: which checkpoints that ship quantized weights are read as stored."""
from __future__ import annotations

from specmoe.config import Fields, Quantization
from specmoe.errors import UnsupportedModelError
from specmoe.families.registry import Family, families_reading

QUANT_METHODS = ("mxfp4", "fp8")


def read_quantization(f: Fields, family: Family, *, hidden: int, expert_intermediate: int) -> Quantization | None:
    """None: a floating-point checkpoint. MXFP4 for the families that ship it (GPT-OSS experts), block-scaled
    FP8 (e4m3, dynamic activations) for the others."""
    q = f.raw.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        f.fail("quantization_config", "an object or null", q)
    qf = Fields(q, f"{f.source} quantization_config")
    method = q.get("quant_method")
    if method not in QUANT_METHODS:
        raise UnsupportedModelError(
            f"{f.source}: quantization_config.quant_method {method!r} is not supported; specmoe reads floating-point "
            "checkpoints, MXFP4 experts as GPT-OSS ships them (\"mxfp4\") and block-scaled FP8 as DeepSeek-V3 ships "
            "it (\"fp8\")")
    if method not in family.quantizations:
        if method == "mxfp4":
            raise UnsupportedModelError(f"{f.source}: MXFP4 (quant_method \"mxfp4\") is read for "
                                        f"{' / '.join(families_reading(method))} experts only")
        also = "".join(f" or {m.upper()}" for m in family.quantizations)
        raise UnsupportedModelError(f"{f.source}: {family.name} checkpoints are read in floating point{also}, "
                                    f"not {method.upper()}")
    if method == "mxfp4":
        for key, n in (("hidden_size", hidden), ("intermediate_size", expert_intermediate)):
            if n % 32:
                f.fail(key, "a multiple of 32 (MXFP4 stores blocks of 32 values along each projection's input)", n)
        return Quantization("mxfp4")
    if qf.str("fmt", "e4m3") not in ("e4m3", "float8_e4m3fn"):  # MiniMax-M2 writes the torch dtype's name
        raise UnsupportedModelError(f"{qf.source}: fmt {q['fmt']!r} is not supported (FP8 e4m3 only)")
    if qf.str("activation_scheme", "dynamic") != "dynamic":
        raise UnsupportedModelError(f"{qf.source}: activation_scheme {q['activation_scheme']!r} is not supported "
                                    "(\"dynamic\" only: specmoe computes on the dequantised weights)")
    if q.get("scale_fmt") not in (None, "float", "ue8m0"):  # ue8m0: float scales that are powers of two
        qf.fail("scale_fmt", '"float" or "ue8m0"', q["scale_fmt"])
    block = q.get("weight_block_size", [128, 128])
    if (not isinstance(block, list) or len(block) != 2
            or any(type(b) is not int or b < 1 for b in block)):
        qf.fail("weight_block_size", "a list of two integers >= 1 (rows, columns of one scale block)", block)
    return Quantization("fp8", (block[0], block[1]))
