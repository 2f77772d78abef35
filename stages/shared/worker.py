"""One long-lived thread for a stage's torch work: ``await worker.run(fn, *args)``.

A model stage's steps, decodes or encodes run off the event loop (torch releases the GIL) on a
thread of the stage's own that lives as long as the stage, not on anyio's pooled workers, which come
and go (idle ones are pruned after 10 s). That keeps what depends on the calling thread fixed for a
session: glibc serves each thread from one arena, so a stage's freed tensors return to one arena's
pool instead of one pool per worker it happened to land on (stages/shared/memory.py); torch's intra-op
thread count and OpenMP team are per thread, so they are set and built once.

On a CUDA device (``cuda_stream``) the thread queues its GPU work on a stream of its own: the sessions
that share a process (an engine's) then queue their kernels side by side instead of in one queue, and
each stage's copy of its result to the host waits for its own kernels only -- on the one default
stream an encode's copy waited for the steps and decodes other sessions had queued before it.

    worker = StageWorker("decode", threads=1)     # the thread starts with the first call
    frames = await worker.run(decode, latent)     # exceptions reach the caller
    worker.close()                                # teardown: the thread ends

One call at a time, in the order callers arrive (the others wait their turn, so the executor never
holds more than one). As with ``anyio.to_thread.run_sync``, a caller cancelled while its call runs
still waits for it to finish: the stage's teardown never overlaps its own torch work.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import anyio

T = TypeVar("T")


def use_own_stream(device: str, urgent: bool = False) -> None:
    """The calling thread's GPU work on ``device`` goes on a new stream of its own from now on. What the
    default stream holds (a build's uploads and captures end on it) runs before this stream's work,
    ordered by an event: a device-wide synchronize would wait on, and so invalidate, another session's
    graph capture in progress.

    ``urgent``: the stream has the device's highest priority, so the block scheduler starts its kernels
    (and the graphs replayed on it) before the queued blocks of other streams' kernels. For small work
    on the reply's path -- a turn's audio encode -- that would otherwise wait behind each DiT kernel
    queued ahead of it, one at a time."""
    import torch

    stream = torch.cuda.Stream(device, priority=-64 if urgent else 0)  # clamped to the highest there is
    stream.wait_stream(torch.cuda.default_stream(device))
    torch.cuda.set_stream(stream)  # the calling thread's current stream


class StageWorker:
    def __init__(self, name: str, threads: int | None = None, cuda_stream: str | None = None,
                 urgent: bool = False) -> None:
        """``threads``: the thread's torch intra-op threads (CPU work; None leaves torch's setting and
        imports no torch). ``cuda_stream``: a CUDA device, whose work from this thread goes on a stream
        of the thread's own (only for work no other thread touches: a batcher's lanes are the batcher's),
        of the highest priority if ``urgent`` (``use_own_stream``)."""
        if threads is not None and threads < 1:
            raise ValueError(f"{name} worker: intra-op threads must be >= 1, got {threads}")
        if cuda_stream is not None and not cuda_stream.startswith("cuda"):
            raise ValueError(f"{name} worker: a stream needs a CUDA device, not {cuda_stream!r}")
        self.name, self.threads, self.cuda_stream, self.urgent = name, threads, cuda_stream, urgent
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=name, initializer=self._started)
        self._turn = anyio.Lock()
        self._closed = False

    def _started(self) -> None:
        if self.threads is not None:
            from charstream.model.threads import set_intra_op_threads

            set_intra_op_threads(self.threads)
        if self.cuda_stream is not None:
            use_own_stream(self.cuda_stream, self.urgent)

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` on the worker's thread; its result, or its exception raised here."""
        async with self._turn:
            if self._closed:
                raise RuntimeError(f"the {self.name} worker is closed")
            future = self._executor.submit(contextvars.copy_context().run, fn, *args)
            with anyio.CancelScope(shield=True):
                return await asyncio.wrap_future(future)

    def close(self) -> None:
        """No more calls; the thread ends (after a call still running, if any). Idempotent."""
        self._closed = True
        self._executor.shutdown(wait=False)
