"""User-facing errors. Everything raised for bad input is a SpecMoEError, so the CLI
and the server can print one clear line instead of a traceback."""


class SpecMoEError(Exception):
    """Base class for errors caused by user input (files, options, prompts)."""


class CheckpointError(SpecMoEError):
    """A checkpoint directory is missing, corrupt, or does not match its config."""


class UnsupportedModelError(SpecMoEError):
    """The checkpoint's architecture is not one specmoe implements."""


class InputError(SpecMoEError):
    """A prompt or option is invalid (empty batch, prompt over the context length...)."""


class MemoryBudgetError(SpecMoEError):
    """A cache or buffer would not fit in the memory the user allowed or the machine has."""


class IntegrityError(CheckpointError):
    """Bytes read back from the expert repack file do not match what was written (corruption, a short read)."""


class NonFiniteLogitsError(SpecMoEError):
    """The model produced inf/NaN logits (overflowing weights, a corrupt checkpoint, fp16 range):
    nothing is sampled from them."""
