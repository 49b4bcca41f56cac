"""Text ⇄ token ids with the `tokenizers` library (no transformers at run time).

tokenizer.json and tokenizer_config.json are checked when loaded: unreadable, non-UTF-8,
not JSON, the wrong shape or a bad special-token entry is one CheckpointError naming the file."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as _Tok

from specmoe.config import read_json_object, type_name
from specmoe.errors import CheckpointError


class Tokenizer:
    def __init__(self, path: Path):
        tok_path = path / "tokenizer.json"
        read_json_object(tok_path)  # shape, encoding and JSON errors as one line naming the file
        try:
            self.tok = _Tok.from_file(str(tok_path))
        except Exception as e:  # the Rust library raises plain Exceptions for malformed models
            raise CheckpointError(f"{tok_path} is not a valid tokenizers file: {str(e).splitlines()[0][:200]}") \
                from None
        cfg_path = path / "tokenizer_config.json"
        self.config = read_json_object(cfg_path) if cfg_path.is_file() else {}
        eos = self.config.get("eos_token")
        if not (eos is None or isinstance(eos, str) or (isinstance(eos, dict) and isinstance(eos.get("content"), str))):
            raise CheckpointError(f"{cfg_path}: eos_token must be a string, an object with a string 'content', "
                                  f"or null; got {type_name(eos)}")

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

    def encode(self, text: str, special: bool = True) -> list[int]:
        """`special`: apply the tokenizer's own template (e.g. BOS); off for text that already holds its
        special tokens (a rendered chat template)."""
        return self.tok.encode(text, add_special_tokens=special).ids

    def encode_in_thread(self, text: str, special: bool = True) -> list[int]:
        """`encode` for a worker thread: the library's batch call releases the GIL while it works (its single
        call holds it), so the thread that handed the text over (a server's event loop) keeps running."""
        return self.tok.encode_batch([text], add_special_tokens=special)[0].ids

    @property
    def max_token_chars(self) -> int:
        """The most characters one token's vocabulary string holds (byte-level BPE stores a byte per
        character, so this bounds the characters of text one token covers)."""
        if not hasattr(self, "_max_token_chars"):
            self._max_token_chars = max((len(t) for t in self.tok.get_vocab(with_added_tokens=True)), default=1)
        return self._max_token_chars

    @property
    def run_tokens(self) -> frozenset[int]:
        """Tokens whose text is known only once a token outside their run follows: with byte fallback
        (SentencePiece's <0xNN> tokens) the decoder turns a whole run of byte tokens into text at once, all
        U+FFFD when any byte in it is invalid, and the special tokens it skips join the runs on either side.
        Empty for every other tokenizer (byte-level BPE decodes each invalid byte on its own)."""
        if not hasattr(self, "_run_tokens"):
            ids: set[int] = set()
            if getattr(self.tok.model, "byte_fallback", False):
                ids = {self.tok.token_to_id(f"<0x{b:02X}>") for b in range(256)} - {None}
                ids |= {i for i, t in self.tok.get_added_tokens_decoder().items() if t.special}
            self._run_tokens = frozenset(ids)
        return self._run_tokens

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)
