"""Intra-op thread count for one piece of work, on the calling thread only.

With torch's OpenMP backend ``torch.set_num_threads`` is per thread, and stages run their torch
work on pooled worker threads (``anyio.to_thread``): setting it once at load time only affects
whichever worker ran the load. So the count is set around each call and restored afterwards.
Small workloads (audio tokens for one chunk) want one thread: on a busy 2-core machine two
OpenMP workers spin against each other and a 5 ms call takes hundreds of ms (measured).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def intra_op_threads(n: int | None) -> Iterator[None]:
    """Run the body with ``n`` intra-op threads on this thread (None: leave torch's setting)."""
    if not n:
        yield
        return
    previous = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(previous)
