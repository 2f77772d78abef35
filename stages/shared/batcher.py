"""One forward for the due work of many sessions of one process: the scheduler both model stages share.

A ``tiny`` session leaves a GPU nearly idle (a few ms of launches per 166.7 ms chunk), so the sessions
of one serving process share one model and submit their work -- a diffusion step
(``stages/diffusion/batcher.py``) or a chunk to decode (``stages/decode/batcher.py``) -- to a
``SessionBatcher``, which runs one forward for everything submitted: as soon as each open session
has one item in, or ``window_s`` after the first arrived. A worker thread (off the event loop) runs
the forwards, and what arrives while one runs goes into the next, so batches grow with the load
(continuous batching, as vLLM's scheduler does).

    batcher.opened()                              # a session joins (subclasses: with their own setup)
    result = await batcher.submit(key, item)      # key: the session's own object; one item pending each
    batcher.closed(key)                           # a session leaves: an item of it still waiting is dropped

Bounded: at most ``max_sessions`` items per forward (a forward that has them goes at once) and one
pending item per session (a second is a clear error). A session that ends while its item waits drops it (the future is cancelled); one that
ends while its item is in a forward leaves the forward to finish (nobody awaits its result). An item
that ``check`` refuses fails its session only; a forward that raises fails the future of every
session in it. A subclass supplies ``check`` and ``forward``; ``forward`` runs under ``self.model_lock``,
which its own joins and leaves take too when they touch the model. ``prepare``, if a subclass has one,
runs on each new worker thread before its first forward (what the model does once per thread).
At the process's exit a forward still running ends first (the worker is a daemon thread: one stopped
inside torch's C++ by the interpreter's finalisation aborts the process), and no other starts.
"""

from __future__ import annotations

import abc
import asyncio
import atexit
import concurrent.futures
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import structlog

log = structlog.get_logger("batcher")

EXIT_WAIT_S = 30.0  # at exit, a forward still running gets this long to end


def _at_exit(ref: weakref.ref) -> None:
    batcher = ref()
    if batcher is not None:
        batcher.model_lock.acquire(timeout=EXIT_WAIT_S)  # kept: no forward starts after this


@dataclass
class _Due:
    key: Any  # the session's own object (identity)
    item: Any
    result: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass
class BatcherStats:
    forwards: int = 0
    steps: int = 0  # session items served (diffusion steps, decoded chunks)
    largest: int = 0  # most items in one forward


class SessionBatcher(abc.ABC):
    def __init__(self, max_sessions: int, window_s: float, threads: int | None = None, name: str = "batcher") -> None:
        """``threads``: the worker's torch intra-op threads (CPU; None leaves torch's setting)."""
        if max_sessions < 2:
            raise ValueError(f"a batcher needs batch_sessions >= 2, got {max_sessions}")
        if window_s < 0:
            raise ValueError(f"batch_window_s must be >= 0, got {window_s}")
        self.max_sessions, self.window_s, self.threads, self.name = max_sessions, window_s, threads, name
        self.stats = BatcherStats()
        self.model_lock = threading.Lock()  # the shared model: one forward (or a subclass's join/leave) at a time
        self._wake = threading.Condition()  # guards _pending, _open, _worker
        self._pending: list[_Due] = []
        self._open = 0
        self._worker: threading.Thread | None = None
        atexit.register(_at_exit, weakref.ref(self))

    # -- the subclass's part (called by the worker) -------------------------------------------------

    def check(self, key: Any, item: Any) -> None:
        """Raise if ``item`` cannot run (it fails its own session only, before any forward); by
        default every item can."""
        return None

    def prepare(self) -> None:
        """Once per worker thread, before its first forward; by default nothing."""
        return None

    @abc.abstractmethod
    def forward(self, keys: list[Any], items: list[Any]) -> list[Any]:
        """One forward for ``items`` (distinct sessions ``keys``): each session's result, in order."""

    # -- sessions -----------------------------------------------------------------------------------

    def opened(self) -> None:
        """A session joined: forwards wait for its items too; the worker starts with the first session."""
        with self._wake:
            self._open += 1
            if self._worker is None:
                self._worker = threading.Thread(target=self._serve, name=self.name, daemon=True)
                self._worker.start()

    def closed(self, key: Any) -> None:
        """A session left: an item of it still waiting is dropped; the worker ends with the last session."""
        with self._wake:
            for due in [d for d in self._pending if d.key is key]:
                self._pending.remove(due)
                due.result.cancel()
            self._open -= 1
            self._wake.notify()

    async def submit(self, key: Any, item: Any) -> Any:
        """``item``'s result, from the next forward that takes it."""
        return await asyncio.wrap_future(self.enqueue(key, item))

    def enqueue(self, key: Any, item: Any) -> concurrent.futures.Future:
        """``submit`` for a caller on a thread: the future of ``item``'s result."""
        due = _Due(key, item)
        with self._wake:
            if any(d.key is key for d in self._pending):
                raise RuntimeError("a session submitted while its previous item is pending")
            self._pending.append(due)
            self._wake.notify()
        return due.result

    # -- the worker ---------------------------------------------------------------------------------

    def _serve(self) -> None:
        """Take what is due, one forward, hand each session its result; ends with the last session."""
        if self.threads:  # torch's intra-op setting is per thread
            from charstream.model.threads import set_intra_op_threads

            set_intra_op_threads(self.threads)
        if type(self).prepare is not SessionBatcher.prepare:
            started = time.monotonic()
            try:
                with self.model_lock:
                    self.prepare()
                # what the first session of this thread waited for, once
                log.info("batcher_prepared", batcher=self.name, seconds=round(time.monotonic() - started, 3))
            except Exception:  # noqa: BLE001 -- a forward that still fails tells its sessions
                log.warning("batcher_prepare_failed", batcher=self.name, exc_info=True)
        while True:
            with self._wake:
                while not self._pending and self._open > 0:
                    self._wake.wait()
                if self._open == 0:
                    self._worker = None
                    return
                deadline = time.monotonic() + self.window_s
                # a full forward goes at once too (more sessions may be open than one forward takes)
                while 0 < len(self._pending) < min(self._open, self.max_sessions) and (left := deadline - time.monotonic()) > 0:
                    self._wake.wait(left)
                taken, self._pending = self._pending[: self.max_sessions], self._pending[self.max_sessions :]
            self._run([d for d in taken if d.result.set_running_or_notify_cancel()])

    def _run(self, dues: list[_Due]) -> None:
        ready = []
        for due in dues:  # an item refused on its own fails its session only
            try:
                self.check(due.key, due.item)
                ready.append(due)
            except Exception as e:  # noqa: BLE001 -- handed to the session that submitted it
                due.result.set_exception(e)
        if not ready:
            return
        try:
            with self.model_lock:
                results = self.forward([d.key for d in ready], [d.item for d in ready])
        except Exception as e:  # noqa: BLE001 -- every session of the failed forward hears it
            for due in ready:
                due.result.set_exception(e)
            return
        self.stats.forwards += 1
        self.stats.steps += len(ready)
        self.stats.largest = max(self.stats.largest, len(ready))
        for due, result in zip(ready, results, strict=True):
            due.result.set_result(result)
