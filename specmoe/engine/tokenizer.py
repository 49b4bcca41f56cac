"""Moved to `specmoe.tokenizer` (below every layer); kept importable here."""
from specmoe.tokenizer import *  # noqa: F401,F403
