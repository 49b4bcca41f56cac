"""Integrations with distributed runtimes (an optional extra: `pip install 'specmoe[ray]'`).

Nothing in the core imports this package. `predictor` (one engine per worker, rows in, rows out) and
`batch_io` (input/output files, the resume journal) need no Ray; `ray` runs the predictor on Ray Data
and `ray_serve` deploys the OpenAI-compatible app on Ray Serve."""
from __future__ import annotations

from specmoe.errors import SpecMoEError


class MissingExtraError(SpecMoEError):
    """An optional dependency (Ray, pyarrow) is not installed; the message names the extra to install."""


def require(module: str, extra: str, what: str):
    """Import `module` or raise MissingExtraError with the install hint for `extra`."""
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError:
        raise MissingExtraError(f"{what} needs the '{extra}' extra (cannot import {module}): "
                                f"pip install 'specmoe[{extra}]'") from None
