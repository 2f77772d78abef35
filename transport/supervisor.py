"""Stage processes: spawn, watch, stop. No orphans, and a death is noticed at once.

* Children are started with ``multiprocessing`` *spawn* (no forked event loops, CUDA-safe).
* Each child asks the kernel for SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)``), and
  exits at once if the parent is already gone: a killed parent leaves no stage process behind.
  PDEATHSIG follows the *thread* that spawned the child, so launch from the event loop's thread.
* Each child's ``Process.sentinel`` is watched on the event loop, so a ``kill -9`` is seen
  within milliseconds; its last words (a report dict) come back over a one-way pipe.
* Children ignore SIGINT from birth (Ctrl-C reaches the whole process group; the parent
  coordinates); SIGTERM stops a child cleanly. Stopping escalates: wait ``grace`` for a clean
  exit, then SIGTERM, then SIGKILL. A child that sent its report runs its exit handlers and exits
  without the interpreter's teardown (seconds of collecting and unloading a model's heap).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import multiprocessing
import multiprocessing.connection
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Linux: SIGKILL this process when its parent dies; exit now if that already happened."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        os._exit(1)


def _stopped(pid: int) -> bool:
    """The process is stopped (job control or ptrace): its state in /proc is T or t."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("T", "t")
    except (OSError, IndexError):
        return False


def describe_exit(exitcode: int | None) -> str:
    if exitcode is None:
        return "still running"
    if exitcode < 0:
        return f"killed by signal {signal.Signals(-exitcode).name}"
    return f"exited with status {exitcode}"


def _child_entry(parent_pid: int, target: Callable[..., dict], results, args: tuple) -> None:
    die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    report = target(*args)
    results.send(report)
    results.close()
    # All that is left is the interpreter's teardown: a full collection of the heap (a model process's
    # frozen heap is unfrozen at exit; one pass took 0.7 s on a busy 2-core host) and unloading torch's
    # modules, which overran the parent's grace, so the process ended by SIGTERM. The exit handlers still
    # run (the log's drain, shared-memory and file cleanups); the teardown does not.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1 if report.get("error") else 0)


@contextlib.contextmanager
def _sigint_ignored():
    """Children inherit an ignored SIGINT through exec, so a terminal's Ctrl-C (sent to the whole
    process group) never reaches them, not even while they are still importing; the parent alone
    turns it into a clean shutdown."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@dataclass
class Child:
    name: str
    process: multiprocessing.process.BaseProcess
    results: multiprocessing.connection.Connection

    _report: dict[str, Any] | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def report(self) -> dict[str, Any] | None:
        """What the child sent before exiting, if anything (None after a kill)."""
        if self._report is None and not self.results.closed:
            try:
                self._report = self.results.recv() if self.results.poll() else None
            except (EOFError, OSError):
                pass
        return self._report


class Supervisor:
    """Launches spawned children and stops them; ``kill_all`` is the last-resort cleanup."""

    def __init__(self) -> None:
        self._mp = multiprocessing.get_context("spawn")
        self.children: dict[str, Child] = {}

    def launch(self, name: str, target: Callable[..., dict], *args: Any, daemon: bool = False) -> Child:
        """Run ``target(*args)`` in a spawned process; it returns a report dict (``error`` key).
        ``daemon``: ended at this process's exit if still running (a child that cannot outlive its
        work, e.g. a TP rank waiting in a collective), instead of waited for."""
        receive, send = self._mp.Pipe(duplex=False)
        process = self._mp.Process(
            target=_child_entry, args=(os.getpid(), target, send, args), name=f"charstream-{name}", daemon=daemon
        )
        with _sigint_ignored():
            process.start()
        send.close()
        self.children[name] = Child(name, process, receive)
        return self.children[name]

    async def wait_exit(self, child: Child) -> int:
        """Returns the child's exit code as soon as it exits (sentinel readable)."""
        await anyio.wait_readable(child.process.sentinel)
        child.process.join()
        return child.process.exitcode

    async def stop_all(self, grace_s: float) -> None:
        """``stop`` every child."""
        await self.stop(list(self.children.values()), grace_s)

    async def stop(self, children: list[Child], grace_s: float) -> None:
        """Wait up to ``grace_s`` for ``children`` to exit, then SIGTERM, then SIGKILL the rest. A
        stopped child (SIGSTOP) can neither exit nor take SIGTERM: it is killed at once."""
        for c in children:
            if c.process.is_alive() and _stopped(c.pid):
                os.kill(c.pid, signal.SIGKILL)
        for sig, wait_s in ((None, grace_s), (signal.SIGTERM, 0.5), (signal.SIGKILL, 1.0)):
            alive = [c for c in children if c.process.is_alive()]
            if sig is not None:
                for c in alive:
                    os.kill(c.pid, sig)
            deadline = time.monotonic() + wait_s
            while alive and time.monotonic() < deadline:
                await anyio.sleep(0.01)
                alive = [c for c in alive if c.process.is_alive()]
            if not alive:
                break
        for c in children:
            c.process.join(timeout=0)

    def kill_all(self) -> None:
        """``kill`` every child."""
        for c in self.children.values():
            self.kill(c)

    def kill(self, child: Child) -> None:
        """Synchronous cleanup for error paths: SIGKILL the child if it still runs, and reap it."""
        if child.process.is_alive():
            child.process.kill()
        child.process.join(timeout=1.0)
        child.report()  # keep its last words before the pipe goes
        child.results.close()
