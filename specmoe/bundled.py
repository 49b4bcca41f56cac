"""Where the bundled demo model and the held-out benchmark prompts are.

In a repository checkout (and an editable install) they are `models/specmoe-tiny-moe/` and
`benchmarks/prompts/` at the repository root. A built wheel carries copies of both inside the
package (`specmoe/demo_model/`, `specmoe/demo_prompts/`: pyproject.toml maps those package
directories onto the repository folders), so an installed `specmoe` needs no checkout.
"""
from __future__ import annotations

from pathlib import Path

from specmoe.errors import SpecMoEError

PACKAGE = Path(__file__).resolve().parent
REPO = PACKAGE.parent
DEMO_MODEL_CANDIDATES = (PACKAGE / "demo_model", REPO / "models" / "specmoe-tiny-moe")
PROMPTS_CANDIDATES = (PACKAGE / "demo_prompts", REPO / "benchmarks" / "prompts")
DEMO_EAGLE_CANDIDATES = (PACKAGE / "demo_eagle", REPO / "models" / "specmoe-tiny-moe-eagle")


def demo_model_dir(check: bool = True) -> Path:
    """The bundled demo checkpoint: the installed copy if there is one, else the repository's.
    When neither holds a config.json: SpecMoEError naming both places (`check=False`: the
    repository's path)."""
    for d in DEMO_MODEL_CANDIDATES:
        if (d / "config.json").is_file():
            return d
    if not check:
        return DEMO_MODEL_CANDIDATES[-1]
    raise SpecMoEError("the bundled demo model is missing (looked in "
                       f"{' and '.join(str(d) for d in DEMO_MODEL_CANDIDATES)}); "
                       "pass model=PATH (--model PATH), a Hugging Face checkpoint directory")


def demo_eagle_dir() -> Path:
    """The EAGLE head trained for the demo model (`scripts/train_eagle.py`): the installed copy if there is
    one, else the repository's; SpecMoEError when neither holds one."""
    for d in DEMO_EAGLE_CANDIDATES:
        if (d / "model.safetensors").is_file():
            return d
    raise SpecMoEError("the demo model's EAGLE head is missing (looked in "
                       f"{' and '.join(str(d) for d in DEMO_EAGLE_CANDIDATES)}); pass eagle_head=PATH")


EAGLE_SUBDIR = "eagle"  # a checkpoint's own EAGLE head (what specmoe.bench.widen writes into a widened copy)


def default_eagle_head(model_dir: str | Path) -> Path | None:
    """The EAGLE head `drafter='eagle'` uses for the checkpoint at `model_dir` when no eagle_head is given: the
    checkpoint's own `eagle/` subdirectory when it holds a head (a widened copy of the demo model carries its
    widened head there), else for the demo model its shipped head (`demo_eagle_dir`); None: no head ships."""
    own = Path(model_dir) / EAGLE_SUBDIR
    if (own / "model.safetensors").is_file():
        return own
    if Path(model_dir).resolve() == demo_model_dir(check=False).resolve():
        return demo_eagle_dir()
    return None


def prompts_dir() -> Path:
    """The held-out prompts folder (`<domain>.jsonl`): the installed copy if there is one, else the
    repository's; the repository's path when neither exists (callers fall back to built-in prompts)."""
    for d in PROMPTS_CANDIDATES:
        if any(d.glob("*.jsonl")):
            return d
    return PROMPTS_CANDIDATES[-1]
