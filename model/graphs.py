"""CUDA graph capture, the one recipe every graphed part uses (the step, the batched step, the decoder,
the batched decoder, the audio encoder).

    stream = torch.cuda.Stream()                         # the owner's capture stream, kept
    graph, output = capture_graph(body, stream)          # under one_capture_at_a_time
    graph.replay()                                       # output: the static tensors the body returned

``capture_graph`` runs ``body`` ``warmup`` times on ``stream`` then records it there. The warm-up runs
compile the Triton kernels, let cuBLAS, cuDNN and cuFFT choose their algorithms and plans, and create
a TP group's NCCL communicator, all outside the capture -- and on the capture stream, as PyTorch asks.
The capture stream is the owner's own, kept for its lifetime: cuBLAS keys its workspace by (handle,
stream), and graphs captured on ``torch.cuda.graph``'s one shared default stream share that workspace --
replayed concurrently (the decoder's graph on a second stream beside the step's), their GEMMs race on it.

Graphs are captured in a process that serves several sessions: each session's parts capture at setup
(a process's batched step and decoder at their first session) in a worker thread, while other
sessions of the same process may be stepping and decoding. Two rules keep that safe. One capture at
a time per process (``one_capture_at_a_time``): ``torch.cuda.graph`` synchronises the device and
empties the allocator's cache on entry, and the warm-up runs compile Triton kernels. And the capture
mode is ``thread_local`` (``CAPTURE_MODE``): in PyTorch's default ``global`` mode a ``cudaMalloc`` or a
synchronisation made by *any other thread* during the capture is an error, which fails either that
session's step or the capture.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

CAPTURE_MODE = "thread_local"
_capture_lock = threading.Lock()
P = ParamSpec("P")
R = TypeVar("R")
T = TypeVar("T")


def one_capture_at_a_time(capture: Callable[P, R]) -> Callable[P, R]:
    """Decorate a method that warms up and captures CUDA graphs: it runs under the process's lock."""

    @functools.wraps(capture)
    def locked(*args: P.args, **kwargs: P.kwargs) -> R:
        with _capture_lock:
            return capture(*args, **kwargs)

    return locked


def capture_graph(body: Callable[[], T], stream: torch.cuda.Stream, warmup: int = 2,
                  pool: tuple[int, int] | None = None) -> tuple[torch.cuda.CUDAGraph, T]:
    """``body`` warmed up ``warmup`` times on ``stream``, then captured there (see the module's docstring):
    the graph and what the captured ``body`` returned (static tensors each replay rewrites). ``pool``:
    a ``torch.cuda.graph_pool_handle()`` shared by graphs that never replay concurrently."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            body()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode=CAPTURE_MODE):
        output = body()
    return graph, output
