"""The model engine: one long-lived process that hosts the model stages of many sessions.

    charstream engine --bind ipc:///tmp/charstream-engine.sock --preset tiny --gpus 1 --batch-sessions 16 [--metrics-port 9465]

A session in ``hosting = "engine"`` keeps its event loop work (ingest, playout, WebRTC egress) in
its front-end process and asks the engine to host its model group -- conditioning (the audio
encoder), diffusion and decode (``pipeline.session.model_nodes``), the stages ``pipeline/runtime/layouts.py``
puts on a GPU -- so the GPU work of every session runs in this one process: one CUDA context (the
kernels of different processes' contexts never overlap on a GPU) and, with ``--batch-sessions N``,
the process's shared ``StepBatcher`` / ``DecodeBatcher`` run the due steps and chunks of up to N
sessions as one forward. Each hosted session is one ``pipeline.runner.GroupRun`` on the engine's
event loop, with its own ZeroMQ context (its CURVE keys) and channels: its edges to the front-end are
ipc (shared-memory slots) or tcp as ``transport.cross_process`` says, its stages register on the
session's control bus like any stage process's.

The protocol is ``pipeline/runtime/engine_link.py``'s (ZeroMQ ROUTER, msgpack, never pickle). A host request
is validated before anything is built (its config through ``PipelineConfig.from_dict``, the preset,
weights and seed this engine serves, the stages, edges and endpoints); a bad one gets an error reply
and the engine goes on serving, as it does past its ``max_sessions``. The engine decides the devices
and the batching of what it hosts (``engine_session_config``). A hosted group ends on the session's
SHUTDOWN, its release, a failed stage, a dead control hub (``PeerDeadError``) or a front-end that
stops pinging for ``dead_after_s``; then it is torn down and forgotten, and the front-end gets the
group's report. The engine binds ipc or loopback tcp only (host requests carry CURVE keys). SIGTERM
or SIGINT ends every hosted group and the process.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
import numpy as np
import zmq
import zmq.asyncio

from charstream.logs import get_logger
from charstream.pipeline import arguments
from charstream.pipeline.config import PipelineConfig
from charstream.pipeline.runtime.engine_link import (
    KEY_FIELDS,
    MAX_PORTRAIT_SIDE,
    MAX_WIRE_BYTES,
    EngineError,
    check_engine_endpoint,
    engine_call,
    pack,
    unpack,
)
from charstream.pipeline.runtime.errors import unwrap
from charstream.pipeline.runtime.loop_lag import LoopLag
from charstream.pipeline.runtime.process import MODEL_STAGES, prepare_process
from charstream.pipeline.runtime.runner import ENGINE_GROUP, Edge, GroupRun, GroupSpec
from charstream.pipeline.session import model_nodes, process_batchers
from charstream.stages.config import TracingConfig
from charstream.stages.shared.metrics import forget_session, serve_metrics
from charstream.transport.channel import Transport
from charstream.transport.security import CurveKeys

if TYPE_CHECKING:
    from charstream.model.families.base import ModelFamily

MAX_EDGE_CAPACITY = 1024  # credits of one edge: far more than any session graph's
STOP_TIMEOUT_S = 15.0  # on SIGTERM, hosted groups get this long to tear down
PROBE_TIMEOUT_S = 0.5  # at start: an engine already serving our ipc path answers within this
# Per model section, the fields a hosted session keeps its own; every other field is the engine's (its
# devices, graphs, step options and batching: the shared model and batchers are the engine's), so a field
# added to a section is the engine's until it is named here.
SESSION_OWN_FIELDS = {
    "conditioning": ("idle_lead_chunks", "rollback_wait_s", "stall_s"),
    "diffusion": ("seed",),
    "decode": (),
}


class RequestError(ValueError):
    """A request the engine refuses (answered with its message; the engine goes on)."""


def engine_session_config(engine: PipelineConfig, session: PipelineConfig, weights: str | None,
                          engine_weights: str | None) -> PipelineConfig:
    """The config a hosted session's model stages run with: the session's, with the engine's devices
    and batching (the shared model and batchers are the engine's). RequestError if the session asks
    for a model this engine does not serve."""
    if session.preset != engine.preset:
        raise RequestError(f"this engine serves preset {engine.preset!r}, not {session.preset!r}")
    if weights != engine_weights:
        raise RequestError(f"this engine serves weights {engine_weights!r}, not {weights!r}")
    batched = engine.diffusion.batch_sessions > 1 or engine.decode.batch_sessions > 1
    if batched and weights is None and session.diffusion.seed != engine.diffusion.seed:
        raise RequestError(f"random weights are seeded by diffusion.seed: this engine's model is seed "
                           f"{engine.diffusion.seed}, not {session.diffusion.seed}")
    sections = {name: dataclasses.replace(getattr(engine, name), **{f: getattr(getattr(session, name), f) for f in own})
                for name, own in SESSION_OWN_FIELDS.items()}
    sections["diffusion"].devices = list(sections["diffusion"].devices)  # not the engine's own list
    return dataclasses.replace(session, hosting="engine", **sections)


def _field(request: dict[str, Any], name: str, kind: type | tuple[type, ...]) -> Any:
    if name not in request:
        raise RequestError(f"missing field {name!r}")
    value = request[name]
    if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
        raise RequestError(f"field {name!r}: expected {getattr(kind, '__name__', kind)}, got {type(value).__name__}")
    return value


def _endpoint(value: Any, what: str, internal: bool) -> str:
    """An edge's endpoint: inproc inside the hosted group, ipc or tcp across its boundary."""
    schemes = ("inproc://",) if internal else ("ipc://", "tcp://")
    if not isinstance(value, str) or not value.startswith(schemes) or len(value) > 512:
        raise RequestError(f"{what}: endpoint {value!r} must start with {' or '.join(schemes)}")
    return value


def _edges(request: dict[str, Any], name: str, hosted: set[str]) -> list[tuple[Edge, str, int]]:
    """The ``inputs`` (``name`` = "inputs": each edge's dst is hosted) or ``outputs`` (src hosted)."""
    edges = []
    for i, e in enumerate(_field(request, name, list)):
        what = f"{name}[{i}]"
        if not isinstance(e, dict) or set(e) != {"src", "dst", "types", "endpoint", "capacity"}:
            raise RequestError(f"{what}: expected a map of src, dst, types, endpoint, capacity")
        src, dst = _field(e, "src", str), _field(e, "dst", str)
        types, capacity = _field(e, "types", list), _field(e, "capacity", int)
        ours = dst if name == "inputs" else src
        if ours not in hosted:
            raise RequestError(f"{what}: {src}->{dst} does not {'enter' if name == 'inputs' else 'leave'} a hosted stage")
        if not all(isinstance(t, str) for t in types) or not 1 <= capacity <= MAX_EDGE_CAPACITY:
            raise RequestError(f"{what}: types must be names, capacity 1..{MAX_EDGE_CAPACITY}")
        endpoint = _endpoint(e["endpoint"], what, internal=src in hosted and dst in hosted)
        edges.append((Edge(src, dst, capacity, tuple(types)), endpoint, capacity))
    return edges


def _portrait(value: Any) -> np.ndarray | None:
    """A host request's portrait (``engine_link.portrait_field``): RGB uint8 (height, width, 3)."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != {"shape", "rgb"}:
        raise RequestError("portrait: expected a map of shape and rgb")
    shape, rgb = value["shape"], value["rgb"]
    if not (isinstance(shape, list) and len(shape) == 3 and shape[2] == 3
            and all(type(n) is int and 1 <= n <= MAX_PORTRAIT_SIDE for n in shape[:2])):
        raise RequestError(f"portrait: shape {shape!r} is not [height, width, 3] of 1..{MAX_PORTRAIT_SIDE} pixels a side")
    if not isinstance(rgb, bytes) or len(rgb) != shape[0] * shape[1] * 3:
        raise RequestError(f"portrait: rgb must be {shape[0] * shape[1] * 3} bytes (uint8, {shape}), got "
                           f"{len(rgb) if isinstance(rgb, bytes) else type(rgb).__name__}")
    return np.frombuffer(rgb, np.uint8).reshape(shape).copy()


def _keys(value: Any) -> CurveKeys | None:
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) != set(KEY_FIELDS) or not all(
            isinstance(value[f], bytes) and len(value[f]) == 40 for f in KEY_FIELDS):
        raise RequestError(f"keys: expected None or Z85 keys (40 bytes each) {', '.join(KEY_FIELDS)}")
    return CurveKeys(**value)


@dataclass
class _HostedGroup:
    """One session's model group in this engine."""

    identity: bytes  # its front-end's link (ROUTER identity)
    session_id: str
    group: GroupRun
    transport: Transport
    dead_after_s: float
    heard: float  # monotonic time of its front-end's last message
    steps_from: int = 0  # diffusion steps before the status window (``status`` with ``mark``)


def describe_device(device: str) -> dict[str, str]:
    """torch's version and, on CUDA, the GPU's name (torch is imported by then: ``run_engine``)."""
    import torch

    info = {"device": device, "torch": torch.__version__}
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(torch.device(device).index or 0)
    return info


def check_engine_config(config: PipelineConfig, max_sessions: int) -> None:
    """ValueError if an engine cannot serve ``max_sessions`` sessions with ``config``'s devices and batching."""
    if config.diffusion.tp != 1:
        raise ValueError(f"the engine hosts diffusion at tp = 1, not {config.diffusion.tp}")
    if max_sessions < 1:
        raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
    for section in ("diffusion", "decode"):
        n = getattr(config, section).batch_sessions  # >= 1: the section's bounds
        if 1 < n < max_sessions:  # a batcher takes at most batch_sessions sessions
            raise ValueError(f"{section}.batch_sessions {n} serves fewer than max_sessions {max_sessions}")


class Engine:
    """Serves host requests on ``endpoint`` until ``run``'s ``stop`` is set. ``config``: the devices,
    preset and batching of what it hosts (``apply_layout`` + ``batch_sessions``); ``weights`` as
    ``build_graph``'s; at most ``max_sessions`` hosted at once. ``family``: the model (default: the one
    ``config.preset`` names; another size of it, e.g. a CPU check). A ``chunk_motion`` family's (FlashHead)
    host request carries the session's portrait, which its stream encodes here."""

    def __init__(self, config: PipelineConfig, weights: str | None, endpoint: str, max_sessions: int,
                 family: ModelFamily | None = None) -> None:
        from charstream.model.families import get_family

        check_engine_config(config, max_sessions)
        self.config, self.weights, self.max_sessions = config, weights, max_sessions
        self.family = family or get_family(config.preset)
        self.endpoint = check_engine_endpoint(endpoint)
        self.batcher, self.decode_batcher, self.encode_batcher = process_batchers(config, self.family, weights)
        self.hosted: dict[bytes, _HostedGroup] = {}
        self.served = 0  # sessions hosted and ended
        self.lag = LoopLag()
        self.log = get_logger(component="engine")
        self.device = describe_device(config.diffusion.device)
        self._sock: zmq.asyncio.Socket | None = None
        self._tg: anyio.abc.TaskGroup | None = None

    async def run(self, stop: anyio.Event) -> None:
        ctx = zmq.asyncio.Context()
        self._sock = ctx.socket(zmq.ROUTER)
        self._sock.linger = 0
        self._sock.router_mandatory = 1  # a reply to a front-end that is gone raises (and is dropped)
        self._sock.maxmsgsize = MAX_WIRE_BYTES
        try:
            await self._check_free()
            self._sock.bind(self.endpoint)
            self.lag.start()
            self.log.info("engine_ready", endpoint=self.endpoint, pid=os.getpid(), preset=self.config.preset,
                     device=self.config.diffusion.device, batch_sessions=self.config.diffusion.batch_sessions,
                     max_sessions=self.max_sessions)
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self._receive)
                tg.start_soon(self._liveness)
                await stop.wait()
                for hosted in self.hosted.values():
                    hosted.group.ended_by = "engine stopping"
                    hosted.group.stop.set()
                with anyio.move_on_after(STOP_TIMEOUT_S):
                    while self.hosted:
                        await anyio.sleep(0.05)
                tg.cancel_scope.cancel()
        finally:
            await self.lag.stop()
            self._sock.close(linger=0)
            ctx.term()

    async def _check_free(self) -> None:
        """An ipc bind takes the path over from an engine still serving there (ZeroMQ unlinks it): refuse."""
        if not self.endpoint.startswith("ipc://"):
            return  # a tcp port in use fails the bind itself
        try:
            status = await engine_call(self.endpoint, {"cmd": "status"}, timeout=PROBE_TIMEOUT_S)
        except EngineError:
            return
        raise RuntimeError(f"an engine (pid {status.get('pid')}) already serves {self.endpoint}")

    async def _send(self, identity: bytes, message: dict[str, Any]) -> None:
        try:
            await self._sock.send_multipart([identity, pack(message)])
        except zmq.ZMQError as e:  # the peer is gone (router_mandatory): nobody to tell
            self.log.debug("engine_reply_dropped", error=str(e))

    async def _receive(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            identity, payload = frames[0], frames[1:]
            cmd = None
            try:
                if len(payload) != 1:
                    raise RequestError(f"expected one frame, got {len(payload)}")
                try:
                    request = unpack(payload[0])
                except ValueError as e:
                    raise RequestError(str(e)) from None
                cmd = request.get("cmd")
                if cmd == "ping":
                    await self._ping(identity)
                elif cmd == "release":
                    self._release(identity)
                elif cmd == "status":
                    await self._send(identity, {"reply": "status", "ok": True, **self.status(bool(request.get("mark")))})
                elif cmd == "host":
                    await self._send(identity, {"reply": "host", "ok": True, **self._host(identity, request)})
                else:
                    raise RequestError(f"unknown command {cmd!r}; known: host, ping, release, status")
            except Exception as e:  # noqa: BLE001 -- a request's fault (or our bug on its data) fails that request only
                error = str(e) if isinstance(e, RequestError) else f"{type(e).__name__}: {e}"
                self.log.warning("engine_request_refused", cmd=cmd if isinstance(cmd, str) else None, error=error)
                reply = cmd if cmd in ("host", "status") else "error"
                await self._send(identity, {"reply": reply, "ok": False, "error": error})

    async def _ping(self, identity: bytes) -> None:
        hosted = self.hosted.get(identity)
        if hosted is None:  # e.g. a link that reconnected to a restarted engine: its group is not here
            await self._send(identity, {"event": "ended", "report": {
                "error": f"the engine at {self.endpoint} (pid {os.getpid()}) hosts no session for this link"}})
            return
        hosted.heard = time.monotonic()
        await self._send(identity, {"event": "pong"})

    def _release(self, identity: bytes) -> None:
        hosted = self.hosted.get(identity)
        if hosted is not None and not hosted.group.stop.is_set():
            hosted.group.ended_by = "released by its front-end"
            hosted.group.stop.set()

    def _host(self, identity: bytes, request: dict[str, Any]) -> dict[str, Any]:
        """Validate a host request and start its group; what the reply says."""
        if identity in self.hosted:
            raise RequestError(f"this link already hosts session {self.hosted[identity].session_id!r}")
        if len(self.hosted) >= self.max_sessions:
            raise RequestError(f"the engine is full: it hosts {len(self.hosted)} of at most {self.max_sessions} sessions")
        session_id = _field(request, "session_id", str)
        if not 0 < len(session_id) <= 128 or any(h.session_id == session_id for h in self.hosted.values()):
            raise RequestError(f"session id {session_id[:128]!r} is empty, too long or already hosted")
        weights = request.get("weights")
        if weights is not None and not isinstance(weights, str):
            raise RequestError(f"field 'weights': expected a string or None, got {type(weights).__name__}")
        try:
            session = PipelineConfig.from_dict(_field(request, "config", dict))
        except (TypeError, ValueError) as e:
            raise RequestError(f"config: {e}") from None
        config = engine_session_config(self.config, session, weights, self.weights)
        portrait = _portrait(request.get("portrait"))
        if self.family.generation_mode == "chunk_motion" and portrait is None:
            raise RequestError(f"model {self.family.name!r} animates a portrait: the request carries none")
        available = {n.name: n for n in model_nodes(config, weights, self.batcher, self.decode_batcher, self.family,
                                                    portrait, self.encode_batcher)}
        names = _field(request, "nodes", list)
        if not names or len(set(names)) != len(names) or not set(names) <= set(available):
            raise RequestError(f"nodes {names!r}: expected distinct names of {', '.join(available)}")
        hosted = set(names)
        inputs, outputs = _edges(request, "inputs", hosted), _edges(request, "outputs", hosted)
        control = _endpoint(request.get("control"), "control", internal=False)
        keys = _keys(request.get("keys"))
        spec = GroupSpec(ENGINE_GROUP, session_id, [available[n] for n in names], inputs, outputs, control, config, keys)
        transport = Transport(config.transport, keys)
        entry = _HostedGroup(identity, session_id, GroupRun(spec, transport, anyio.Event(), build_in_thread=True), transport,
                        config.transport.dead_after_s, time.monotonic())
        self.hosted[identity] = entry
        self._tg.start_soon(self._run_hosted, entry)
        self.log.info("engine_hosting", session_id=session_id, stages=names, hosted=len(self.hosted))
        return {"pid": os.getpid(), "hosted": len(self.hosted)}

    async def _run_hosted(self, hosted: _HostedGroup) -> None:
        group = hosted.group
        try:
            await group.run()
        except Exception as e:  # channel set-up failures (bind, CURVE policy)
            group.error = group.error or f"the engine's group of session {hosted.session_id!r} failed: {type(e).__name__}: {e}"
        finally:
            with anyio.CancelScope(shield=True):
                hosted.transport.close()
                forget_session(hosted.session_id)  # its step series (its playout, elsewhere, drops the rest)
                del self.hosted[hosted.identity]
                self.served += 1
                self.log.info("engine_session_ended", session_id=hosted.session_id, ended_by=group.ended_by,
                         error=group.error, hosted=len(self.hosted))
                await self._send(hosted.identity, {"event": "ended", "report": group.report()})

    async def _liveness(self) -> None:
        """A front-end that stops pinging is gone: its group stops (a group still setting up hears no hub)."""
        beat = self.config.transport.heartbeat_s
        last = time.monotonic()
        while True:
            await anyio.sleep(beat)
            now = time.monotonic()
            stalled, last = now - last > beat + self.config.transport.dead_after_s / 2, now
            for hosted in list(self.hosted.values()):
                if stalled:  # our own loop was late: we could not have heard them
                    hosted.heard = now
                elif now - hosted.heard > hosted.dead_after_s and not hosted.group.stop.is_set():
                    self.log.warning("engine_frontend_silent", session_id=hosted.session_id, silent_s=round(now - hosted.heard, 2))
                    hosted.group.ended_by = f"its front-end stopped pinging for {hosted.dead_after_s:g} s"
                    hosted.group.stop.set()

    def status(self, mark: bool = False) -> dict[str, Any]:
        """What the engine hosts, its batchers' forwards, its loop's lag and the diffusion step times
        (ms) since the last ``mark`` (which starts a new window)."""
        steps: list[float] = []
        for hosted in self.hosted.values():
            diffusion = hosted.group.stages.get("diffusion")
            times = list(diffusion.stats.step_s) if diffusion is not None else []
            steps.extend(times[hosted.steps_from:])
            if mark:
                hosted.steps_from = len(times)
        batchers = {kind: {"forwards": b.stats.forwards, "served": b.stats.steps}
                    for kind, b in (("diffusion", self.batcher), ("decode", self.decode_batcher),
                                    ("encode", self.encode_batcher)) if b is not None}
        status = {"pid": os.getpid(), "now": time.monotonic(), "device": self.device, "hosted": len(self.hosted),
                  "served": self.served,
                  "max_sessions": self.max_sessions, "sessions": [h.session_id for h in self.hosted.values()],
                  "batchers": batchers, "loop_lag": self.lag.summary(), "step_ms": [round(s * 1e3, 3) for s in steps]}
        if mark:
            self.lag.samples.clear()
        return status


def engine_config(preset: str, gpus: str | None, batch_sessions: int) -> PipelineConfig:
    """The engine's devices and batching: ``gpus`` a layout of ``pipeline/runtime/layouts.py`` (tp 1), None: CPU."""
    config = PipelineConfig(preset=preset)
    if gpus:
        from charstream.pipeline.runtime.layouts import apply_layout

        config = apply_layout(config, gpus)
    config.diffusion.batch_sessions = config.decode.batch_sessions = batch_sessions
    config.conditioning.batch_sessions = batch_sessions  # a chunk model's audio encodes (FlashHead)
    return config


def run_engine(config: PipelineConfig, weights: str | None, endpoint: str, max_sessions: int,
               log_level: str | None = None, family: ModelFamily | None = None) -> dict[str, Any]:
    """The engine's process (``charstream engine``, or a ``Supervisor`` target): serves until SIGTERM
    or SIGINT; returns its report. With ``config.tracing.prometheus_port``, its hosted sessions' step
    times and its process metrics are served for Prometheus (``tracing.prometheus_host``). ``family``
    as ``Engine``'s."""
    # Before the loop serves: an import inside it (or one a stage's thread holds the import lock of while
    # the loop wants the module) stalls every hosted session's heartbeats for seconds.
    prepare_process("engine", config, MODEL_STAGES, log_level)
    if config.tracing.prometheus_port is not None:
        serve_metrics(config.tracing.prometheus_port, config.tracing.prometheus_host)
    import torch

    try:
        if config.diffusion.device.startswith("cuda"):
            torch.cuda.init()
            torch.zeros(1, device=config.diffusion.device)  # the context, before any session's heartbeats run
        engine = Engine(config, weights, endpoint, max_sessions, family)
    except (RuntimeError, ValueError, AssertionError) as e:  # no such device, a bad config
        return {"error": f"engine at {endpoint}: {type(e).__name__}: {e}", "served": 0}

    async def main() -> None:
        stop = anyio.Event()
        async with anyio.create_task_group() as tg:

            async def on_signal() -> None:
                with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
                    async for _ in signals:
                        stop.set()

            tg.start_soon(on_signal)
            await engine.run(stop)
            tg.cancel_scope.cancel()

    try:
        anyio.run(main)
    except Exception as e:
        e = unwrap(e)
        return {"error": f"engine at {endpoint}: {type(e).__name__}: {e}", "served": engine.served}
    return {"served": engine.served}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--bind", default=PipelineConfig().engine_endpoint,
                        help="ipc://PATH or tcp://127.0.0.1:PORT (loopback only; default: %(default)s)")
    parser.add_argument("--preset", default="tiny", help="model preset of every hosted session (default: tiny)")
    parser.add_argument("--weights", default="packaged",
                        help="'packaged' (the trained weights shipped), 'random', or a FlashHead model's weights folder")
    parser.add_argument("--gpus", metavar="LAYOUT", default=None,
                        help="GPU layout of the hosted stages (pipeline/runtime/layouts.py, tp 1: 1 or 1+1); default: CPU")
    parser.add_argument("--batch-sessions", type=int, default=1,
                        help="diffusion steps and decodes of up to N sessions in one forward (1: off)")
    parser.add_argument("--max-sessions", type=int, default=None,
                        help="sessions hosted at once, more are refused (default: --batch-sessions, or 16 without batching)")
    parser.add_argument("--metrics-port", type=arguments.port, default=None,
                        help="serve Prometheus metrics (the hosted sessions' step times, the process's) on this port")
    parser.add_argument("--metrics-host", default=TracingConfig().prometheus_host,
                        help="the metrics listener's address (default: %(default)s)")
    arguments.add_size_arguments(parser)


def run(args: argparse.Namespace) -> int:
    max_sessions = args.max_sessions or (args.batch_sessions if args.batch_sessions > 1 else 16)
    try:
        family = arguments.sized_family(args.preset, args.blocks, args.size, args.vae_width)
        weights = arguments.model_weights(args.preset, args.weights)
        config = engine_config(args.preset, args.gpus, args.batch_sessions)
        config.tracing.prometheus_port, config.tracing.prometheus_host = args.metrics_port, args.metrics_host
        check_engine_endpoint(args.bind)
        check_engine_config(config, max_sessions)  # a bad layout, preset or count fails here, before torch
    except ValueError as e:
        raise SystemExit(f"charstream engine: {e}") from None
    report = run_engine(config, weights, args.bind, max_sessions, family=family)
    if report.get("error"):
        print(report["error"], file=sys.stderr)
        return 1
    return 0
