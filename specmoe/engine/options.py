"""Moved to `specmoe.options` (below every layer, beside `ModelConfig`); kept importable here."""
from specmoe.options import *  # noqa: F401,F403
