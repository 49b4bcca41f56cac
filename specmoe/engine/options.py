"""Runtime knobs as small frozen dataclasses. `LLM(**kwargs)` and the CLI are generated
from these fields (each field's `help` metadata becomes the flag's help text)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields


def opt(default, help: str, choices: tuple | None = None):
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True)
class OffloadConfig:
    """Where experts live and how the bounded device expert cache behaves (see specmoe/experts)."""
    offload: str = opt("none", "backing tier of expert weights", ("none", "host", "disk"))


@dataclass(frozen=True)
class SpecConfig:
    """Decoding strategy and speculative-decoding knobs (see specmoe/decoding)."""
    decoding: str = opt("ar", "decoding strategy", ("ar",))


def split_options(kwargs: dict) -> tuple[OffloadConfig, SpecConfig]:
    """Route LLM(**kwargs) keywords to the config that owns them; unknown names are an error."""
    from specmoe.errors import InputError
    groups = {}
    for cls in (OffloadConfig, SpecConfig):
        names = {f.name for f in fields(cls)}
        groups[cls] = {k: kwargs.pop(k) for k in list(kwargs) if k in names}
    if kwargs:
        raise InputError(f"unknown option(s): {', '.join(sorted(kwargs))}")
    return OffloadConfig(**groups[OffloadConfig]), SpecConfig(**groups[SpecConfig])
