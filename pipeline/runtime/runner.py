"""Wires stages from a graph and runs a session, in one process (inproc://) or across processes.

A ``Graph`` names nodes (the stage's class or factory + its kwargs, and a process group; a spawned
process gets the node pickled, so its class and kwargs must pickle — classes do, by reference) and edges (from, to, capacity, optionally the message types they carry).
``run_session(graph, config, session_id)`` runs it and returns a ``SessionResult``; ``SessionRunner``
does the same with a ``stop()`` and the ids of its processes.

Hosting (``config.hosting``): ``inproc`` runs every node in this process over inproc://;
``processes`` runs group ``"main"`` here and spawns one process per other group, with ipc://
(or tcp://, ``config.transport.cross_process``) between processes and inproc:// inside each;
``engine``: group ``"engine"`` is hosted by a running model engine (``pipeline/runtime/engine.py``,
``config.engine_endpoint``) beside other sessions' groups, the rest as in ``processes``. Each
group is run by a ``GroupHost`` (``pipeline/runtime/hosts.py``: ``InprocHost``, ``ChildHost``,
``EngineHost``), chosen by ``make_host``; the session treats them alike.

Per stage: ``setup`` -> register on the control bus -> (once every stage of the session is set
up) ``run`` as a task beside the dispatch loop that feeds ``control`` first, then ``process`` ->
``teardown``, always. The session ends when a stage sends ``Control(SHUTDOWN)``, when ``stop()``
is called or SIGINT/SIGTERM arrives (clean), or with an error naming the stage when a stage
raises or its process dies; then every stage gets SHUTDOWN and every process is stopped.
"""

from __future__ import annotations

import importlib
import os
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from typing import Any

import anyio

from charstream.logs import configure_logging, get_logger
from charstream.pipeline.config import PipelineConfig
from charstream.pipeline.runtime.errors import unwrap
from charstream.pipeline.runtime.hosts import ChildHost, EngineHost, GroupHost, InprocHost
from charstream.pipeline.runtime.process import prepare_process
from charstream.stages.base import Stage, StageContext
from charstream.transport.channel import (
    ControlClient,
    ControlHub,
    PeerDeadError,
    Receiver,
    Sender,
    Transport,
    Wakeup,
    free_tcp_port,
)
from charstream.transport.messages import Control, ControlKind, ErrorPayload, Message, ShutdownPayload
from charstream.transport.security import CurveKeys, curve_required
from charstream.transport.supervisor import Supervisor

LOCAL_GROUP = "main"  # in "processes" hosting, this group runs in the caller's process
ENGINE_GROUP = "engine"  # in "engine" hosting, the model engine process hosts this group (pipeline/runtime/engine.py)
STOP_GRACE_S = 1.0  # how long stage processes get to exit after SHUTDOWN before SIGTERM


@dataclass
class Node:
    name: str
    factory: Callable[..., Stage] | str  # the stage class (or a factory), or "package.module:Class"; called with **kwargs
    kwargs: dict[str, Any] = field(default_factory=dict)
    group: str = LOCAL_GROUP  # process group: nodes of one group share a process


@dataclass
class Edge:
    src: str
    dst: str
    capacity: int | None = None  # None: TransportConfig.capacities[name] or default_capacity
    types: tuple[str, ...] = ()  # message type names carried (e.g. ("Conditioning",)); () = all

    @property
    def name(self) -> str:
        return f"{self.src}->{self.dst}"


@dataclass
class Graph:
    nodes: list[Node]
    edges: list[Edge] = field(default_factory=list)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Graph:
        """``{"nodes": [{"name", "factory", "kwargs"?, "group"?}], "edges": [{"from", "to", "capacity"?, "types"?}]}``"""
        nodes = [Node(**n) for n in data["nodes"]]
        edges = [
            Edge(e["from"], e["to"], e.get("capacity"), tuple(e.get("types", ()))) for e in data.get("edges", [])
        ]
        return cls(nodes, edges)

    def validate(self) -> None:
        names = [n.name for n in self.nodes]
        if len(set(names)) != len(names):
            raise ValueError(f"graph: duplicate node names in {names}")
        for n in self.nodes:
            if isinstance(n.factory, str) and ":" not in n.factory:
                raise ValueError(f"graph: node {n.name!r}: factory {n.factory!r} is not 'module:Class'")
            if not isinstance(n.factory, str) and not callable(n.factory):
                raise ValueError(f"graph: node {n.name!r}: factory {n.factory!r} is neither callable nor 'module:Class'")
        edge_names = [e.name for e in self.edges]
        if len(set(edge_names)) != len(edge_names):
            raise ValueError(f"graph: duplicate edges in {edge_names}")
        for e in self.edges:
            if e.src not in names or e.dst not in names:
                raise ValueError(f"graph: edge {e.name} names an unknown node (nodes: {names})")
            if e.capacity is not None and e.capacity < 1:
                raise ValueError(f"graph: edge {e.name}: capacity must be >= 1")


@dataclass
class SessionResult:
    session_id: str
    ok: bool
    ended_by: str  # "shutdown by <stage>", "stop: <reason>", "signal SIGTERM", or "error"
    error: str | None = None
    failed_stage: str | None = None
    duration_s: float = 0.0
    edges: dict[str, dict[str, Any]] = field(default_factory=dict)  # edge -> {"sender": .., "receiver": ..}
    processes: dict[str, int] = field(default_factory=dict)  # group -> pid (spawned groups)
    exit_codes: dict[str, int | None] = field(default_factory=dict)  # group -> exit code (0: clean)
    stops: dict[str, dict[str, Any]] = field(default_factory=dict)  # group -> how its process ended when stopped
    stages: dict[str, Stage] = field(default_factory=dict)  # stage objects that ran in this process


@dataclass
class GroupSpec:
    """Everything one process needs to run its nodes (picklable for spawn)."""

    group: str
    session_id: str
    nodes: list[Node]
    inputs: list[tuple[Edge, str, int]]  # (edge, endpoint, capacity) for edges into this group
    outputs: list[tuple[Edge, str, int]]  # (edge, endpoint, capacity) for edges out of this group's nodes
    control_endpoint: str
    config: PipelineConfig
    keys: CurveKeys | None


def resolve_factory(factory: Callable[..., Stage] | str) -> Callable[..., Stage]:
    if not isinstance(factory, str):
        return factory
    module, _, attr = factory.partition(":")
    return getattr(importlib.import_module(module), attr)


def build_stage(node: Node) -> Stage:
    return resolve_factory(node.factory)(**node.kwargs)


class GroupRun:
    """The nodes of one process group: channels, contexts, lifecycle, failure reporting.

    ``build_in_thread``: construct the stages in a worker thread (the model engine's loop serves
    other sessions while one session's stages load their weights)."""

    def __init__(self, spec: GroupSpec, transport: Transport, stop: anyio.Event, build_in_thread: bool = False) -> None:
        self.spec = spec
        self.build_in_thread = build_in_thread
        self.transport = transport
        self.stop = stop
        self.stages: dict[str, Stage] = {}
        self.error: str | None = None
        self.failed_stage: str | None = None
        self.ended_by = "stop"
        self.clients: dict[str, ControlClient] = {}
        self.receivers: dict[str, list[Receiver]] = {n.name: [] for n in spec.nodes}
        self.senders: dict[str, list[tuple[tuple[str, ...], Sender]]] = {n.name: [] for n in spec.nodes}
        self.wakeups = {n.name: Wakeup() for n in spec.nodes}
        self._seq = 0

    async def fail(self, stage: str, exc: BaseException) -> None:
        """Record the first failure, tell the session (Control ERROR), stop the group.

        A peer that stopped answering heartbeats is the failed stage, not the one that noticed.
        """
        if self.error is not None:
            return
        culprit, why = stage, f"{type(exc).__name__}: {exc}"
        if isinstance(exc, PeerDeadError) and exc.peer != "hub":
            culprit, why = exc.peer, f"stopped answering heartbeats (noticed by {stage!r}: {exc})"
        self.error = f"stage {culprit!r} failed: {why}"
        self.failed_stage = culprit
        self.ended_by = "error"
        get_logger(session_id=self.spec.session_id, stage=stage).error(
            "stage_failed", error=self.error, traceback="".join(traceback.format_exception(exc))
        )
        self._seq += 1
        await self.clients[stage].send(Control(self.spec.session_id, self._seq, ControlKind.ERROR,
                                               payload=ErrorPayload(culprit, why)))
        self.stop.set()

    def context(self, name: str) -> StageContext:
        outs = self.senders[name]

        async def emit(msg: Message) -> None:
            kind = type(msg).__name__
            targets = [s for types, s in outs if not types or kind in types]
            if not targets:
                raise RuntimeError(f"stage {name!r} emitted a {kind} but has no outgoing edge for it")
            for sender in targets:
                await sender.send(msg)

        async def send_control(msg: Control) -> None:
            await self.clients[name].send(msg)
            if msg.kind == ControlKind.SHUTDOWN:  # the bus does not echo to the sender: stop here too
                self.ended_by = f"shutdown by {name}"
                self.stop.set()

        return StageContext(
            stage=name,
            session_id=self.spec.session_id,
            emit=emit,
            send_control=send_control,
            log=get_logger(session_id=self.spec.session_id, stage=name),
        )

    async def dispatch(self, name: str, ctx: StageContext) -> None:
        """Control first (it overtakes data), then data round-robin over the stage's inputs.

        A stage with ``control_during_process`` has its ``process`` run as a task, so control keeps
        being delivered while it waits (playout waiting for buffer room must still hear a turn
        start); the next data message is taken only once that ``process`` returned."""
        stage, client, receivers, wakeup = self.stages[name], self.clients[name], self.receivers[name], self.wakeups[name]
        turn = 0
        processed: anyio.Event | None = None  # set when the running process() task returns

        async def process_then_wake(msg: Message, done: anyio.Event) -> None:
            await stage.process(msg, ctx)
            done.set()
            wakeup.notify()

        async with anyio.create_task_group() as tg:
            while True:
                ready = wakeup.arm()
                control = client.take()
                if control is not None:
                    await stage.control(control, ctx)
                    if control.kind == ControlKind.SHUTDOWN:
                        self.ended_by = "shutdown"
                        self.stop.set()
                        tg.cancel_scope.cancel()
                        return
                    continue
                if processed is not None and not processed.is_set():
                    await ready.wait()
                    continue
                for i in range(len(receivers)):
                    msg = await receivers[(turn + i) % len(receivers)].take()
                    if msg is not None:
                        turn = (turn + i + 1) % len(receivers)
                        if stage.control_during_process:
                            processed = anyio.Event()
                            tg.start_soon(process_then_wake, msg, processed)
                        else:
                            await stage.process(msg, ctx)
                        break
                else:
                    await ready.wait()

    async def guarded(self, name: str, work) -> None:
        try:
            await self.clients[name].started.wait()
            await work()
        except Exception as e:
            await self.fail(name, unwrap(e))  # a stage task's own error, not its task group

    async def run(self) -> None:
        spec = self.spec
        async with AsyncExitStack() as stack:
            for node in spec.nodes:
                self.clients[node.name] = await stack.enter_async_context(
                    ControlClient(self.transport, spec.control_endpoint, node.name, self.wakeups[node.name])
                )
            for edge, endpoint, capacity in spec.inputs:
                self.receivers[edge.dst].append(await stack.enter_async_context(
                    Receiver(self.transport, endpoint, edge.name, capacity, self.wakeups[edge.dst])
                ))
            for edge, endpoint, capacity in spec.outputs:  # the capacity sizes an ipc sender's slot ring
                sender = await stack.enter_async_context(Sender(self.transport, endpoint, edge.name, edge.src, capacity))
                self.senders[edge.src].append((edge.types, sender))
            contexts = {n.name: self.context(n.name) for n in spec.nodes}
            try:
                await self._lifecycle(contexts)
            finally:
                with anyio.CancelScope(shield=True):
                    for name, stage in reversed(self.stages.items()):
                        try:
                            await stage.teardown()
                        except Exception as e:
                            await self.fail(name, e)

    async def _lifecycle(self, contexts: dict[str, StageContext]) -> None:
        for node in self.spec.nodes:
            try:
                self.stages[node.name] = (await anyio.to_thread.run_sync(build_stage, node) if self.build_in_thread
                                          else build_stage(node))
                await self.stages[node.name].setup(contexts[node.name])
            except Exception as e:
                await self.fail(node.name, e)
                return
        for client in self.clients.values():
            await client.register()
        async with anyio.create_task_group() as tg:
            for name, stage in self.stages.items():
                ctx = contexts[name]
                tg.start_soon(self.guarded, name, lambda s=stage, c=ctx: s.run(c))
                tg.start_soon(self.guarded, name, lambda n=name, c=ctx: self.dispatch(n, c))
            await self.stop.wait()
            tg.cancel_scope.cancel()

    def report(self) -> dict[str, Any]:
        edges: dict[str, dict[str, Any]] = {}
        for receivers in self.receivers.values():
            for r in receivers:
                edges.setdefault(r.name, {})["receiver"] = r.stats.as_dict()
        for senders in self.senders.values():
            for _, s in senders:
                edges.setdefault(s.name, {})["sender"] = s.stats.as_dict()
        return {
            "group": self.spec.group,
            "error": self.error,
            "failed_stage": self.failed_stage,
            "ended_by": self.ended_by,
            "edges": edges,
        }


def _group_process(spec: GroupSpec) -> dict[str, Any]:
    """Entry point of a spawned stage process: run the group until SHUTDOWN/SIGTERM, return its report."""
    # The stages' modules (torch and all) before any channel or heartbeat starts, as every process's
    # preparation imports its own (class factories were imported when the spec was unpickled).
    for node in spec.nodes:
        resolve_factory(node.factory)
    prepare_process("stage", spec.config, [node.name for node in spec.nodes])

    async def main() -> dict[str, Any]:
        transport = Transport(spec.config.transport, spec.keys)
        stop = anyio.Event()
        group = GroupRun(spec, transport, stop)
        try:
            async with anyio.create_task_group() as tg:

                async def on_sigterm() -> None:
                    with anyio.open_signal_receiver(signal.SIGTERM) as signals:
                        async for _ in signals:
                            group.ended_by = "signal SIGTERM"
                            stop.set()

                tg.start_soon(on_sigterm)
                await group.run()
                tg.cancel_scope.cancel()
        except Exception as e:  # channel set-up failures (bind, CURVE policy) end up here
            group.error = group.error or f"process group {spec.group!r} failed: {type(e).__name__}: {e}"
        finally:
            transport.close()
        return group.report()

    return anyio.run(main)


def plan_groups(graph: Graph, config: PipelineConfig, session_id: str, ipc_dir: str) -> list[GroupSpec]:
    """One GroupSpec per process: endpoints inproc inside a process, ipc/tcp between processes."""
    graph.validate()
    group_of = {n.name: (LOCAL_GROUP if config.hosting == "inproc" else n.group) for n in graph.nodes}
    distributed = len(set(group_of.values())) > 1 or LOCAL_GROUP not in group_of.values()
    tconf = config.transport
    counter = iter(range(1_000_000))

    def endpoint(local: bool) -> str:
        if local:
            return f"inproc://{session_id}/{next(counter)}"
        if tconf.cross_process == "tcp":
            host = f"[{tconf.tcp_host}]" if ":" in tconf.tcp_host else tconf.tcp_host
            return f"tcp://{host}:{free_tcp_port(tconf.tcp_host)}"
        if tconf.cross_process != "ipc":
            raise ValueError(f"transport.cross_process must be ipc or tcp, got {tconf.cross_process!r}")
        return f"ipc://{ipc_dir}/{next(counter)}.sock"

    control = endpoint(not distributed)
    specs = {
        g: GroupSpec(g, session_id, [n for n in graph.nodes if group_of[n.name] == g], [], [], control, config, None)
        for g in dict.fromkeys(group_of.values())
    }
    for e in graph.edges:
        ep = endpoint(group_of[e.src] == group_of[e.dst])
        capacity = e.capacity or tconf.capacities.get(e.name, tconf.default_capacity)
        specs[group_of[e.dst]].inputs.append((e, ep, capacity))
        specs[group_of[e.src]].outputs.append((e, ep, capacity))
    return list(specs.values())


def make_host(spec: GroupSpec, transport: Transport, supervisor: Supervisor) -> GroupHost:
    """Where ``spec``'s group runs (``pipeline/runtime/hosts.py``): group ``main`` in this process,
    group ``engine`` in the model engine with ``hosting = "engine"``, any other in a child process."""
    if spec.group == LOCAL_GROUP:
        return InprocHost(spec, GroupRun(spec, transport, anyio.Event()))
    if spec.group == ENGINE_GROUP and spec.config.hosting == "engine":
        return EngineHost(spec, STOP_GRACE_S)
    return ChildHost(spec, supervisor, _group_process)


class SessionRunner:
    """One running session: ``await session.run()``; ``session.stop()`` ends it cleanly."""

    def __init__(
        self, graph: Graph, config: PipelineConfig, session_id: str, *, handle_signals: bool = True
    ) -> None:
        self.graph = graph
        self.config = config
        self.session_id = session_id
        self.handle_signals = handle_signals and threading.current_thread() is threading.main_thread()
        self.started = anyio.Event()  # every stage is set up and running
        self.pids: dict[str, int] = {}  # process group -> pid, once launched
        self.ended_at: float | None = None  # time.monotonic() when the end (or the error) was decided
        self.log = get_logger(session_id=session_id)
        self._ended = anyio.Event()
        self._result: SessionResult | None = None
        self._hosts: list[GroupHost] = []
        self._host_of: dict[str, GroupHost] = {}  # stage -> the host of its group
        self._silent: set[str] = set()  # process groups whose stages stopped answering: frozen, no grace

    @property
    def stages(self) -> dict[str, Stage]:
        """The stage objects that run in this process, as they are built."""
        return {name: stage for host in self._hosts for name, stage in host.stages.items()}

    def stop(self, reason: str = "requested") -> None:
        """End the session cleanly (idempotent; call from the session's event loop)."""
        self._end(True, f"stop: {reason}")

    async def wait_ending(self) -> SessionResult:
        """The result as soon as the end is decided, while the teardown still runs."""
        await self._ended.wait()
        return self._result

    def _end(self, ok: bool, ended_by: str, error: str | None = None, stage: str | None = None) -> None:
        if self._ended.is_set():
            return
        if error is not None and stage in self._host_of:
            error = self._host_of[stage].describe_error(error)
        self._result = SessionResult(self.session_id, ok, ended_by, error, stage)
        self.ended_at = time.monotonic()
        (self.log.info if ok else self.log.error)("session_ending", ended_by=ended_by, error=error)
        self._ended.set()

    def _on_control(self, msg: Control, sender: str) -> None:
        if msg.kind == ControlKind.ERROR:
            payload = msg.payload
            stage, why = (payload.stage, payload.error) if isinstance(payload, ErrorPayload) else (sender, "no reason given")
            self._end(False, "error", f"stage {stage!r} failed: {why}", stage)
        elif msg.kind == ControlKind.SHUTDOWN:
            self._end(True, f"shutdown by {sender}")

    def _on_silent(self, stage: str) -> None:
        self._silent.add(self._host_of[stage].group if stage in self._host_of else stage)
        self._end(False, "error", f"stage {stage!r} failed: stopped answering heartbeats (noticed by the control hub)", stage)

    async def _signals(self) -> None:
        with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
            async for signum in signals:
                self._end(True, f"signal {signal.Signals(signum).name}")

    async def run(self) -> SessionResult:
        configure_logging()
        start = time.monotonic()
        config = self.config
        with tempfile.TemporaryDirectory(prefix="cs-") as ipc_dir:
            specs = plan_groups(self.graph, config, self.session_id, ipc_dir)
            endpoints = [specs[0].control_endpoint] + [ep for s in specs for _, ep, _ in s.inputs]
            keys = CurveKeys.generate() if any(curve_required(ep, config.transport.curve) for ep in endpoints) else None
            for s in specs:
                s.keys = keys
            transport = Transport(config.transport, keys)
            supervisor = Supervisor()
            self._hosts = [make_host(spec, transport, supervisor) for spec in specs]
            self._host_of = {name: host for host in self._hosts for name in host.stage_names}
            try:
                expected = {n.name for n in self.graph.nodes}
                async with ControlHub(transport, specs[0].control_endpoint, expected, self._on_control, self._on_silent) as hub:
                    async with anyio.create_task_group() as tg:
                        for host in self._hosts:
                            host.start()
                            if host.child_pid is not None:
                                self.pids[host.group] = host.child_pid
                            tg.start_soon(host.run, self._end, self._ended)
                        if self.handle_signals:
                            tg.start_soon(self._signals)
                        tg.start_soon(self._mark_started, hub)
                        await self._ended.wait()
                        await hub.broadcast(Control(self.session_id, 0, ControlKind.SHUTDOWN,
                                                    payload=ShutdownPayload(self._result.ended_by)))
                        async with anyio.create_task_group() as stopping:
                            for host in self._hosts:
                                stopping.start_soon(host.stop, STOP_GRACE_S, host.group in self._silent)
                        tg.cancel_scope.cancel()
            finally:
                for host in self._hosts:
                    host.kill()
                transport.close()
        result = self._result
        result.duration_s = time.monotonic() - start
        result.processes = dict(self.pids)
        result.exit_codes = {h.group: h.exit_code for h in self._hosts if h.child_pid is not None}
        result.stops = {h.group: h.stop_outcome for h in self._hosts if h.stop_outcome is not None}
        result.stages = self.stages
        for host in self._hosts:
            report = host.report()
            for edge, ends in (report or {}).get("edges", {}).items():
                result.edges.setdefault(edge, {}).update(ends)
        return result

    async def _mark_started(self, hub: ControlHub) -> None:
        await hub.started.wait()
        self.started.set()
        self.log.info("session_started", pids=self.pids, pid=os.getpid())


async def run_session(graph: Graph, config: PipelineConfig, session_id: str) -> SessionResult:
    """Run a session until a stage sends SHUTDOWN, a stage fails, or SIGINT/SIGTERM arrives."""
    return await SessionRunner(graph, config, session_id).run()
