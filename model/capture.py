"""CUDA graph capture in a process that serves several sessions.

Each session's diffusion step and decoder capture their graphs at setup (``model/step.py``,
``model/graphed_decoder.py``; a process's batched step and decoder at their first session,
``model/batched_decoder.py``) in a worker thread, while other sessions of the same process may be
stepping and decoding. Two rules keep that safe. One capture at a time per process
(``one_capture_at_a_time``): ``torch.cuda.graph`` synchronises the device and empties the
allocator's cache on entry, and the warm-up runs before it compile Triton kernels. And the capture
mode is ``thread_local`` (``CAPTURE_MODE``): in PyTorch's default ``global`` mode a ``cudaMalloc``
or a synchronisation made by *any other thread* during the capture is an error, which fails either
that session's step or the capture.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import ParamSpec, TypeVar

CAPTURE_MODE = "thread_local"
_capture_lock = threading.Lock()
P = ParamSpec("P")
R = TypeVar("R")


def one_capture_at_a_time(capture: Callable[P, R]) -> Callable[P, R]:
    """Decorate a method that warms up and captures CUDA graphs: it runs under the process's lock."""

    @functools.wraps(capture)
    def locked(*args: P.args, **kwargs: P.kwargs) -> R:
        with _capture_lock:
            return capture(*args, **kwargs)

    return locked
