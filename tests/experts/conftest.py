import pytest
import torch


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one intra-op thread is ~10x faster than two on a shared, busy CPU."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
