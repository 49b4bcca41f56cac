"""Moved to `specmoe.memory` (below every layer: the models' KV cache checks its size too); kept importable here."""
from specmoe.memory import *  # noqa: F401,F403
