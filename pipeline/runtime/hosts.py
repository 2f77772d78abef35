"""Where a session's process groups run: one interface, one implementation per kind of host.

The runner (``pipeline/runtime/runner.py``) plans a session's nodes into process groups and gives
each group a ``GroupHost``; from then on it treats every host alike: ``start``, ``run`` (returns once
the group ended, having told the session how), ``stop`` once the session ends, ``kill`` as the last
resort, and ``report`` for the group's edges. Which host a group gets is decided in one place,
``runner.make_host``, from ``config.hosting``:

* ``InprocHost``: the group runs in this process, on this event loop (``inproc``; group ``main``
  otherwise).
* ``ChildHost``: a spawned child process of the session's ``Supervisor`` runs the group (a group of
  its own in ``processes`` and ``engine``); its death is the session's error.
* ``EngineHost``: a running model engine (``pipeline/runtime/engine.py``) hosts the group beside
  other sessions' (group ``engine`` in ``engine``), over ``engine_link``'s protocol.
"""

from __future__ import annotations

import abc
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import anyio

from charstream.pipeline.runtime.engine_link import EngineError, EngineLink, host_request
from charstream.transport.supervisor import Child, Supervisor, describe_exit

if TYPE_CHECKING:
    from charstream.pipeline.runtime.runner import GroupRun, GroupSpec
    from charstream.stages.base import Stage

# How a group's end reaches its session: (ok, ended_by, error, failed stage), as SessionRunner._end takes them.
EndSession = Callable[[bool, str, "str | None", "str | None"], None]


class GroupHost(abc.ABC):
    """One process group of a session, wherever it runs."""

    def __init__(self, spec: GroupSpec) -> None:
        self.spec = spec

    @property
    def group(self) -> str:
        return self.spec.group

    @property
    def stage_names(self) -> list[str]:
        return [n.name for n in self.spec.nodes]

    @property
    def child_pid(self) -> int | None:
        """The pid of the process this session spawned for the group (None: none of its own)."""
        return None

    @property
    def exit_code(self) -> int | None:
        """The spawned process's exit code once it exited (None: still running, or none spawned)."""
        return None

    @property
    def stages(self) -> dict[str, Stage]:
        """The group's stage objects, as they are built, when they run in this process."""
        return {}

    @property
    def stop_outcome(self) -> dict[str, Any] | None:
        """How the spawned process ended once stopped (``StopOutcome.as_dict``; None: none of its own)."""
        return None

    def start(self) -> None:  # noqa: B027 -- only a child host has something to start
        """Begin hosting (a child is spawned here, so its pid is known at once)."""

    @abc.abstractmethod
    async def run(self, end: EndSession, ended: anyio.Event) -> None:
        """Until the group ends: then tell ``end`` how (a failure, a stage's SHUTDOWN) unless the
        session ended first (``ended``)."""

    @abc.abstractmethod
    async def stop(self, grace_s: float, frozen: bool) -> None:
        """The session ended (every stage got SHUTDOWN): stop the group, return once it is gone.
        ``frozen``: its stages stopped answering heartbeats, so it cannot shut down by itself."""

    def kill(self) -> None:  # noqa: B027 -- only a child host has a process to kill
        """Last-resort cleanup, synchronous (error paths)."""

    @abc.abstractmethod
    def report(self) -> dict[str, Any] | None:
        """The group's report (``edges``, ``error``, ``ended_by``) if it gave one."""

    def describe_error(self, error: str) -> str:
        """``error`` (a stage of this group failed) with where the group ran, when that is not obvious."""
        return error

    def end_by_report(self, end: EndSession, report: dict[str, Any] | None, otherwise: str) -> None:
        """End the session as the group's report says: its error, its clean shutdown, or ``otherwise``."""
        if report is not None and report.get("error"):
            end(False, "error", report["error"], report.get("failed_stage"))
        elif report is not None and report.get("ended_by", "").startswith("shutdown"):
            end(True, report["ended_by"], None, None)
        else:
            stages = self.stage_names
            end(False, "error", f"stage {', '.join(map(repr, stages))} {otherwise}", stages[0] if stages else None)


class InprocHost(GroupHost):
    """The group on this process's event loop."""

    def __init__(self, spec: GroupSpec, group: GroupRun) -> None:
        super().__init__(spec)
        self.group_run = group
        self._done = anyio.Event()

    @property
    def stages(self) -> dict[str, Stage]:
        return self.group_run.stages

    async def run(self, end: EndSession, ended: anyio.Event) -> None:
        group = self.group_run
        try:
            await group.run()
        except Exception as e:  # channel set-up failures (bind, CURVE policy)
            group.error = group.error or f"process group {self.group!r} failed: {type(e).__name__}: {e}"
        finally:
            self._done.set()
        if group.error:
            end(False, "error", group.error, group.failed_stage)
        elif group.ended_by.startswith("shutdown by"):
            end(True, group.ended_by, None, None)

    async def stop(self, grace_s: float, frozen: bool) -> None:
        self.group_run.stop.set()
        await self._done.wait()

    def report(self) -> dict[str, Any] | None:
        return self.group_run.report()


class ChildHost(GroupHost):
    """The group in a child process of ``supervisor``, running ``target(spec)`` (which returns the
    group's report)."""

    def __init__(self, spec: GroupSpec, supervisor: Supervisor, target: Callable[[GroupSpec], dict[str, Any]]) -> None:
        super().__init__(spec)
        self.supervisor = supervisor
        self.target = target
        self.child: Child | None = None

    @property
    def child_pid(self) -> int | None:
        return None if self.child is None else self.child.pid

    @property
    def exit_code(self) -> int | None:
        return None if self.child is None else self.child.process.exitcode

    @property
    def stop_outcome(self) -> dict[str, Any] | None:
        return None if self.child is None or self.child.stopped is None else self.child.stopped.as_dict()

    def start(self) -> None:
        self.child = self.supervisor.launch(self.group, self.target, self.spec)

    async def run(self, end: EndSession, ended: anyio.Event) -> None:
        code = await self.supervisor.wait_exit(self.child)
        self.end_by_report(end, self.child.report(),
                           f"(process group {self.group!r}, pid {self.child.pid}) died: {describe_exit(code)}")

    async def stop(self, grace_s: float, frozen: bool) -> None:
        await self.supervisor.stop([self.child], grace_s, frozen=frozen)  # a frozen process cannot shut down

    def kill(self) -> None:
        if self.child is not None:
            self.supervisor.kill(self.child)

    def report(self) -> dict[str, Any] | None:
        return None if self.child is None else self.child.report()


class EngineHost(GroupHost):
    """The group in the model engine at ``config.engine_endpoint``: asked to host it, then watched
    over the link until the group's report comes, the session ends (the group is released) or the
    engine goes silent (the session's error, naming the engine)."""

    def __init__(self, spec: GroupSpec, release_grace_s: float) -> None:
        super().__init__(spec)
        self.endpoint = spec.config.engine_endpoint
        self.release_grace_s = release_grace_s  # how long a released group's report is waited for
        self.engine_pid: int | None = None  # once the engine accepted
        self._report: dict[str, Any] | None = None
        self._done = anyio.Event()

    async def run(self, end: EndSession, ended: anyio.Event) -> None:
        spec, stages = self.spec, self.stage_names
        weights = {n.kwargs["weights"] for n in spec.nodes if "weights" in n.kwargs}
        # a chunk model's session stream (pipeline/session.py) holds the portrait the engine's stream encodes
        portrait = next((n.kwargs["stream"].portrait for n in spec.nodes if "stream" in n.kwargs), None)
        try:
            if len(weights) != 1:
                raise EngineError(f"the engine group's stages name different weights: {sorted(map(str, weights))}")
            request = host_request(spec.session_id, spec.config, weights.pop(), stages, spec.inputs, spec.outputs,
                                   spec.control_endpoint, spec.keys, portrait)
            async with EngineLink(self.endpoint, spec.config.transport) as link:
                await link.host(request)
                self.engine_pid = link.pid
                report = await link.serve(ended, self.release_grace_s)
            if report is not None and "edges" in report:  # a group's report (not a restarted engine's "not here")
                self._report = report
            if not ended.is_set():
                self.end_by_report(end, report, f"ended by the engine: {(report or {}).get('ended_by')}")
        except (EngineError, ValueError) as e:  # refused, unanswered or silent (the error names the engine)
            end(False, "error", f"stage {', '.join(map(repr, stages))} failed: {e}", stages[0])
        finally:
            self._done.set()

    async def stop(self, grace_s: float, frozen: bool) -> None:
        """``run``'s link releases the group as the session ends and waits ``release_grace_s`` for its report."""
        await self._done.wait()

    def report(self) -> dict[str, Any] | None:
        return self._report

    def describe_error(self, error: str) -> str:
        if self.endpoint in error:
            return error
        return f"{error} (hosted by the engine at {self.endpoint}, pid {self.engine_pid})"
