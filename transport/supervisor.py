"""Stage processes: spawn, watch, stop. No orphans, and a death is noticed at once.

* Children are started with ``multiprocessing`` *spawn* (no forked event loops, CUDA-safe).
* Each child asks the kernel for SIGKILL when its parent dies (``prctl(PR_SET_PDEATHSIG)``), and
  exits at once if the parent is already gone: a killed parent leaves no stage process behind.
  PDEATHSIG follows the *thread* that spawned the child, so launch from the event loop's thread.
* Each child's ``Process.sentinel`` is watched on the event loop, so a ``kill -9`` is seen
  within milliseconds; its last words (a report dict) come back over a one-way pipe.
* Children ignore SIGINT from birth (Ctrl-C reaches the whole process group; the parent
  coordinates); SIGTERM stops a child cleanly. Stopping escalates: wait ``grace`` for a clean
  exit, then SIGTERM, then SIGKILL. Each stopped child's ``StopOutcome`` says how long it took and
  which signal, if any, it needed; a signal is also a ``stage_process_signalled`` warning. A child that sent its report runs its exit handlers and exits
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

from charstream.logs import get_logger

PR_SET_PDEATHSIG = 1
TERM_WAIT_S = 0.5  # after SIGTERM, before SIGKILL
KILL_WAIT_S = 1.0  # after SIGKILL, for the kernel to reap it


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
class StopOutcome:
    """How one child ended when it was stopped."""

    exit_s: float | None  # from the stop's start to its exit as seen (10 ms polls); None: still running
    grace_s: float
    signal: str | None = None  # the strongest signal it needed: None (left by itself), SIGTERM, SIGKILL
    why: str | None = None  # why the signal: "grace exceeded", "frozen", "stopped (SIGSTOP)"
    exitcode: int | None = None

    def as_dict(self) -> dict[str, Any]:
        return {"exit_s": None if self.exit_s is None else round(self.exit_s, 3), "grace_s": self.grace_s,
                "signal": self.signal, "why": self.why, "exitcode": self.exitcode}


@dataclass
class Child:
    name: str
    process: multiprocessing.process.BaseProcess
    results: multiprocessing.connection.Connection

    _report: dict[str, Any] | None = None
    stopped: StopOutcome | None = None  # set by ``Supervisor.stop``

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

    async def stop(self, children: list[Child], grace_s: float, frozen: bool = False) -> None:
        """Wait up to ``grace_s`` for ``children`` to exit, then SIGTERM, then SIGKILL the rest. A
        stopped child (SIGSTOP) can neither exit nor take SIGTERM, nor can a ``frozen`` one (it stopped
        answering): it is killed at once. Each child's ``stopped`` says how it went; a child that needed
        a signal is a warning naming it, the signal and how long it took."""
        started = time.monotonic()
        for c in children:
            c.stopped = StopOutcome(None, grace_s)

        def signal_child(c: Child, sig: signal.Signals, why: str) -> None:
            os.kill(c.pid, sig)
            if c.stopped.signal != signal.SIGKILL.name:  # the strongest one sent is what it needed
                c.stopped.signal, c.stopped.why = sig.name, why

        for c in children:
            if c.process.is_alive() and (frozen or _stopped(c.pid)):
                signal_child(c, signal.SIGKILL, "frozen" if frozen else "stopped (SIGSTOP)")
        alive = list(children)
        for sig, wait_s in ((None, grace_s), (signal.SIGTERM, TERM_WAIT_S), (signal.SIGKILL, KILL_WAIT_S)):
            if sig is not None:
                for c in alive:
                    with contextlib.suppress(ProcessLookupError):  # it exited between the poll and now
                        signal_child(c, sig, "grace exceeded")
            deadline = time.monotonic() + wait_s
            while True:
                now = time.monotonic()
                for c in alive:
                    if not c.process.is_alive():
                        c.stopped.exit_s = now - started
                alive = [c for c in alive if c.stopped.exit_s is None]
                if not alive or now >= deadline:
                    break
                await anyio.sleep(0.01)
            if not alive:
                break
        for c in children:
            c.process.join(timeout=0)
            outcome = c.stopped
            outcome.exitcode = c.process.exitcode
            if outcome.signal is not None:
                get_logger(process=c.name, pid=c.pid).warning(
                    "stage_process_signalled", signal=outcome.signal, why=outcome.why, grace_s=grace_s,
                    exit_s=None if outcome.exit_s is None else round(outcome.exit_s, 3),
                    exit=describe_exit(outcome.exitcode))

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
