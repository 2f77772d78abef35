"""The link between a front-end session and the model engine (``pipeline/runtime/engine.py``): the wire
format, and the front-end's end of it.

A session in ``hosting = "engine"`` opens one DEALER to the engine's ROUTER (``PipelineConfig.
engine_endpoint``: ipc, or tcp on loopback) and asks it to host its model stages. msgpack both ways,
never pickle, one frame per message (a dict):

    front-end -> engine  {"cmd": "host", "session_id", "config": dataclasses.asdict(PipelineConfig),
                          "weights", "nodes": [stage names], "inputs" / "outputs": [{"src", "dst",
                          "types", "endpoint", "capacity"}], "control": the hub's endpoint,
                          "keys": {"server_public", "server_secret", "client_public", "client_secret"} | None}
                         {"cmd": "ping"} every ``transport.heartbeat_s`` while hosted
                         {"cmd": "release"} when the session ends (its group may still be setting up,
                         where the control bus's SHUTDOWN does not reach it)
    engine -> front-end  {"reply": "host", "ok": true, "pid", "hosted"} | {"reply": ..., "ok": false, "error"}
                         {"event": "pong"}; {"event": "ended", "report": the group's report}
    any client           {"cmd": "status", "mark"?: bool} -> {"reply": "status", "ok": true, "pid", "hosted",
                          "sessions", "max_sessions", "batchers", "loop_lag", "step_ms"}

Either end that hears nothing from the other for ``transport.dead_after_s`` takes it for dead: the
front-end ends its session with an error naming the engine, the engine tears the session's group down.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import anyio
import msgpack
import numpy as np
import zmq
import zmq.asyncio

from charstream.pipeline.config import PipelineConfig
from charstream.transport.config import TransportConfig
from charstream.transport.security import CurveKeys, is_loopback

MAX_PORTRAIT_SIDE = 2048  # pixels: a host request's portrait (FlashHead), RGB, is at most 12 MiB
MAX_WIRE_BYTES = 16 << 20  # a request or reply larger than this is refused (a config is a few KB, a portrait more)
HOST_TIMEOUT_S = 10.0  # the engine answers a host request once validated, before building anything
KEY_FIELDS = ("server_public", "server_secret", "client_public", "client_secret")


class EngineError(RuntimeError):
    """The engine refused a request, did not answer, or stopped answering."""


def check_engine_endpoint(endpoint: str) -> str:
    """``endpoint`` if an engine may listen there: ipc, or tcp on loopback (a host request carries the
    session's CURVE keys, so the engine's own socket never leaves the host)."""
    if not isinstance(endpoint, str) or not (
            endpoint.startswith("ipc://") and len(endpoint) > len("ipc://")
            or endpoint.startswith("tcp://") and is_loopback(endpoint)):
        raise ValueError(f"engine endpoint {endpoint!r}: must be ipc://PATH or tcp://127.0.0.1:PORT (loopback only)")
    return endpoint


def pack(message: dict[str, Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(frame: bytes) -> dict[str, Any]:
    """One message; ValueError naming the problem if it is not a msgpack map within the size limit."""
    if len(frame) > MAX_WIRE_BYTES:
        raise ValueError(f"message of {len(frame)} bytes, at most {MAX_WIRE_BYTES}")
    try:
        message = msgpack.unpackb(frame, raw=False, strict_map_key=True)
    except ValueError as e:  # msgpack's errors for bad bytes (ExtraData, FormatError, StackError, ...) are ValueErrors
        raise ValueError(f"not msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(message, dict):
        raise ValueError(f"expected a map, got {type(message).__name__}")
    return message


def host_request(session_id: str, config: PipelineConfig, weights: str | None, nodes: list[str],
                 inputs: list[tuple[Any, str, int]], outputs: list[tuple[Any, str, int]], control: str,
                 keys: CurveKeys | None, portrait: np.ndarray | None = None) -> dict[str, Any]:
    """The host request of a session's engine group (``inputs`` / ``outputs``: the runner's
    ``(Edge, endpoint, capacity)`` triples; ``portrait``: the RGB uint8 face a portrait model animates)."""
    def edges(triples: list[tuple[Any, str, int]]) -> list[dict[str, Any]]:
        return [{"src": e.src, "dst": e.dst, "types": list(e.types), "endpoint": ep, "capacity": cap}
                for e, ep, cap in triples]

    return {"cmd": "host", "session_id": session_id, "config": dataclasses.asdict(config), "weights": weights,
            "nodes": nodes, "inputs": edges(inputs), "outputs": edges(outputs), "control": control,
            "keys": None if keys is None else {f: getattr(keys, f) for f in KEY_FIELDS},
            "portrait": None if portrait is None else portrait_field(portrait)}


def portrait_field(portrait: np.ndarray) -> dict[str, Any]:
    """A portrait as a host request carries it; ValueError if it is not RGB uint8 within ``MAX_PORTRAIT_SIDE``."""
    if portrait.dtype != np.uint8 or portrait.ndim != 3 or portrait.shape[2] != 3 \
            or max(portrait.shape[:2]) > MAX_PORTRAIT_SIDE:
        raise ValueError(f"a portrait for the engine is RGB uint8 of at most {MAX_PORTRAIT_SIDE} pixels a side, "
                         f"got {portrait.dtype} {portrait.shape}")
    return {"shape": list(portrait.shape), "rgb": np.ascontiguousarray(portrait).tobytes()}


class _Socket:
    """A DEALER to the engine, its own ZeroMQ context (a session's link lives as long as the session)."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = check_engine_endpoint(endpoint)
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.linger = 0
        self.sock.maxmsgsize = MAX_WIRE_BYTES
        self.sock.reconnect_ivl = 20
        self.sock.connect(endpoint)

    async def send(self, message: dict[str, Any]) -> None:
        await self.sock.send(pack(message))

    async def recv(self, timeout: float) -> dict[str, Any] | None:
        """The next message, or None after ``timeout`` seconds."""
        if not await self.sock.poll(max(0, int(timeout * 1e3))):
            return None
        return unpack(await self.sock.recv())

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


async def engine_call(endpoint: str, request: dict[str, Any], timeout: float = HOST_TIMEOUT_S) -> dict[str, Any]:
    """One request (``status``, for a bench or an operator) and its reply; EngineError if refused or unanswered."""
    link = _Socket(endpoint)
    try:
        await link.send(request)
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            reply = await link.recv(left)
            if reply is not None and "reply" in reply:
                if not reply.get("ok"):
                    raise EngineError(f"the engine at {endpoint} refused {request.get('cmd')!r}: {reply.get('error')}")
                return reply
        raise EngineError(f"the engine at {endpoint} did not answer {request.get('cmd')!r} within {timeout:g} s")
    finally:
        link.close()


class EngineLink:
    """A session's link to the engine that hosts its model group: ``host``, then ``serve`` until the
    group ends (its report), the session ends (release), or the engine goes silent (EngineError)."""

    def __init__(self, endpoint: str, transport: TransportConfig) -> None:
        self.endpoint = endpoint
        self.transport = transport
        self.pid: int | None = None
        self._link: _Socket | None = None

    async def __aenter__(self) -> EngineLink:
        self._link = _Socket(self.endpoint)
        return self

    async def __aexit__(self, *exc_info: Any) -> bool:
        self._link.close()
        return False

    async def host(self, request: dict[str, Any], timeout: float = HOST_TIMEOUT_S) -> dict[str, Any]:
        """Ask the engine to host the group; its acceptance, or EngineError with its reason."""
        await self._link.send(request)
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            reply = await self._link.recv(left)
            if reply is not None and reply.get("reply") == "host":
                if not reply.get("ok"):
                    raise EngineError(f"the engine at {self.endpoint} refused the session: {reply.get('error')}")
                self.pid = reply.get("pid")
                return reply
        raise EngineError(f"no engine answered at {self.endpoint} within {timeout:g} s")

    async def serve(self, ending: anyio.Event, grace_s: float) -> dict[str, Any] | None:
        """Ping the engine until it reports the group ended (returns its report). Once ``ending`` is
        set, release the group and wait at most ``grace_s`` for that report (None if it does not come).
        EngineError when the engine is silent for ``dead_after_s``."""
        beat, dead_after = self.transport.heartbeat_s, self.transport.dead_after_s
        heard = last_tick = time.monotonic()
        released_at: float | None = None
        next_ping = 0.0
        while True:
            now = time.monotonic()
            if now - last_tick > dead_after / 2:  # our own loop stalled: we could not have heard it
                heard = now
            last_tick = now
            if now - heard > dead_after:
                raise EngineError(f"the engine at {self.endpoint} (pid {self.pid}) stopped answering "
                                  f"for {dead_after:g} s")
            if ending.is_set() and released_at is None:
                released_at = now
                await self._link.send({"cmd": "release"})
            if released_at is not None and now - released_at > grace_s:
                return None
            if now >= next_ping:
                await self._link.send({"cmd": "ping"})
                next_ping = now + beat
            message = await self._link.recv(min(beat, max(0.0, next_ping - time.monotonic())) if not ending.is_set()
                                            else 0.05)
            if message is None:
                continue
            heard = time.monotonic()
            if message.get("event") == "ended":
                return message.get("report") or {}
