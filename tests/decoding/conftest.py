"""Decoding tests run many tiny forwards on one intra-op thread (the root conftest's `one_thread`)."""
from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield
