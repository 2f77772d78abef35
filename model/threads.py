"""Intra-op threads of the calling thread, set once for the thread's life.

With torch's OpenMP backend the intra-op thread count is per thread, so a thread that runs torch
work (a stage's worker, a batcher's) sets its own. torch also initialises each thread's count
lazily, at its first parallel op, from the count any thread set last: a ``set_num_threads`` before
that first op is overwritten as soon as another thread sets a different one (measured, torch
2.13). Small workloads (audio tokens for one chunk) want one thread: on a busy 2-core machine two
OpenMP workers spin against each other and a 5 ms call takes hundreds of ms (measured).
"""

from __future__ import annotations

import torch


def set_intra_op_threads(n: int) -> None:
    """This thread's torch intra-op threads, from now on (``n`` >= 1)."""
    if n < 1:
        raise ValueError(f"intra-op threads must be >= 1, got {n}")
    torch.get_num_threads()  # the thread's lazy initialisation, done now so it cannot undo ``n`` later
    torch.set_num_threads(n)
