"""Shared pytest fixtures."""

import pytest
from charstream.model.threads import intra_op_threads


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny ops: one thread is as fast, and does not collapse when other jobs share the CPU."""
    with intra_op_threads(1):
        yield
