"""The families' registry: every module under specmoe/families/ other than the shared machinery registers exactly
one Family, named as the module, and `family_of` finds each by its model_type and aliases."""
from __future__ import annotations

import importlib
import pkgutil

import pytest

import specmoe.families as families
from specmoe.errors import UnsupportedModelError
from specmoe.families.registry import ALIASES, FAMILIES, family_of

MACHINERY = {"registry", "reader", "parts", "quantization"}


def test_every_family_module_registers_its_family():
    modules = {m.name for m in pkgutil.iter_modules(families.__path__)} - MACHINERY
    assert modules == set(FAMILIES), "a family module that is not imported by specmoe/families/__init__.py?"
    for name in modules:
        mod = importlib.import_module(f"specmoe.families.{name}")
        assert mod.FAMILY is FAMILIES[name] and mod.FAMILY.model_type == name


def test_family_of_model_types_and_aliases():
    assert [family_of(mt).model_type for mt in FAMILIES] == list(FAMILIES)
    assert ALIASES == {"kimi_k2": "deepseek_v3", "nllb-moe": "nllb_moe"} and family_of("kimi_k2") is FAMILIES["deepseek_v3"]
    assert family_of("nllb-moe") is FAMILIES["nllb_moe"]  # transformers writes it with a hyphen
    with pytest.raises(UnsupportedModelError, match="unsupported model_type 'gpt2'; supported: mixtral, qwen2_moe"):
        family_of("gpt2")
