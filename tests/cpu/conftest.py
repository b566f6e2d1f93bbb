"""CPU-tier fixtures."""

import pytest


@pytest.fixture(autouse=True)
def single_intra_op_thread():
    """The tensors here are tiny: intra-op threads only add synchronisation, and under xdist
    they oversubscribe the cores."""
    import torch  # here, not at the top: the controller of an xdist run loads this file too

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
