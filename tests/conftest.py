"""Shared pytest fixtures."""

import pytest
import torch
from charstream.model.threads import set_intra_op_threads


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny ops: one thread is as fast, and does not collapse when other jobs share the CPU."""
    previous = torch.get_num_threads()
    set_intra_op_threads(1)
    yield
    torch.set_num_threads(previous)
