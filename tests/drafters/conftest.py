import pytest
import torch


@pytest.fixture
def one_thread():
    """Tiny tensors: intra-op threads only add overhead (hugely so on a loaded machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
