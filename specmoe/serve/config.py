"""The server's settings (`specmoe serve` flags, `build_app(llm, config)`)."""
from __future__ import annotations

from dataclasses import dataclass

from specmoe.errors import InputError
from specmoe.options import check_int, check_number


@dataclass(frozen=True)
class ServeConfig:
    """`model_name`: the id clients pass as `model` (None: the checkpoint directory's name, the demo model's
    is specmoe-tiny-moe). `api_key`: when set, /v1/* needs `Authorization: Bearer <key>` (/health and
    /metrics stay open). `max_waiting`: requests admitted to the queue but not yet running; beyond it a
    request is answered 429 with Retry-After. `request_timeout_s`: a request not done this long after its
    arrival is aborted (its slot freed) and answered 504; a request asking for more completions (prompts × n)
    than `max_waiting` could never be queued and is answered 400. `max_n`: the largest `n` a request may ask
    for.

    What one client may cost the server (`specmoe.serve.http`): `max_body_bytes`: a larger request body is
    answered 413 without being parsed. `header_timeout_s`: a request's headers must arrive within this long
    of its first byte (or of the connection opening), else 408 and the connection closes.
    `body_timeout_s`: its body must arrive within this long of its headers (408). `keep_alive_timeout_s`: an
    idle keep-alive connection closes after this long (uvicorn's timeout_keep_alive)."""
    host: str = "127.0.0.1"
    port: int = 8000
    model_name: str | None = None
    api_key: str | None = None
    max_waiting: int = 256
    request_timeout_s: float = 600.0
    retry_after_s: int = 1
    max_n: int = 16
    max_logprobs: int = 20
    max_body_bytes: int = 4 * 2**20
    header_timeout_s: float = 5.0
    body_timeout_s: float = 10.0
    keep_alive_timeout_s: float = 5.0

    def __post_init__(self):
        check_int("port", self.port, 0, 65535)
        check_int("max_waiting", self.max_waiting, 1)
        check_number("request_timeout_s", self.request_timeout_s)
        check_int("retry_after_s", self.retry_after_s, 1)
        check_int("max_n", self.max_n, 1)
        check_int("max_logprobs", self.max_logprobs, 0)
        check_int("max_body_bytes", self.max_body_bytes, 1)
        for name in ("header_timeout_s", "body_timeout_s", "keep_alive_timeout_s"):
            check_number(name, getattr(self, name))
        if self.model_name is not None and (not isinstance(self.model_name, str) or not self.model_name.strip()):
            raise InputError(f"model_name must be a non-empty string, got {self.model_name!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise InputError("api_key must be a non-empty string (or None for no key)")


def served_name(llm, config: ServeConfig) -> str:
    """The model id clients see."""
    if config.model_name:
        return config.model_name
    from specmoe.bundled import DEMO_MODEL_CANDIDATES
    if any(llm.path.resolve() == d.resolve() for d in DEMO_MODEL_CANDIDATES):
        return "specmoe-tiny-moe"
    return llm.path.resolve().name
