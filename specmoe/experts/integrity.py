"""Per-expert checksums of the repack file, verified on every read.

The checksum is XXH3-64 (the `xxhash` package) over the padded expert: a non-cryptographic 64-bit hash that reads
at memory speed on one core (about 16 GB/s on this project's AMD EPYC machines, `benchmarks/kernels_bench.py`
measures it), so verifying a read costs a fraction of the read. Any changed bit, a swapped, zeroed or misplaced
block changes it except with probability about 2^-64.
"""
from __future__ import annotations

import numpy as np
import torch
import xxhash

NAME = "xxh3-64"  # recorded in the manifest: a repack with another scheme is rebuilt


def checksum(buf) -> int:
    """Checksum of `buf`: a uint8 numpy array or CPU tensor (contiguous)."""
    a = buf.numpy() if isinstance(buf, torch.Tensor) else np.asarray(buf)
    return xxhash.xxh3_64_intdigest(np.ascontiguousarray(a).view(np.uint8))
