import pytest


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """Tiny models run on one intra-op thread (the root conftest's `one_thread`)."""
    yield
