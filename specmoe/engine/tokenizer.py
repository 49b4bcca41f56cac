"""Text ⇄ token ids with the `tokenizers` library (no transformers at run time)."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _Tok


class Tokenizer:
    def __init__(self, path: Path):
        self.tok = _Tok.from_file(str(path / "tokenizer.json"))
        cfg_path = path / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}

    @classmethod
    def load(cls, path: str | Path) -> "Tokenizer | None":
        path = Path(path)
        return cls(path) if (path / "tokenizer.json").is_file() else None

    def token_id(self, token: str | dict | None) -> int | None:
        if isinstance(token, dict):
            token = token.get("content")
        return self.tok.token_to_id(token) if token else None

    @property
    def eos_token_id(self) -> int | None:
        return self.token_id(self.config.get("eos_token"))

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=True).ids  # the tokenizer's own template (e.g. BOS)

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)
