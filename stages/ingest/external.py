"""External agent over ZeroMQ: any process that speaks the msgpack protocol of docs/AGENTS.md drives
charstream (``IngestConfig.adapter = "zmq"``).

charstream binds a ROUTER at ``IngestConfig.zmq_endpoint``; the agent connects a DEALER, says
``hello``, then sends ``turn_start`` / ``audio`` (+ one raw PCM frame) / ``turn_end``; charstream sends
back ``welcome``, ``user_speech_start`` / ``user_speech_end`` (from its VAD), ``interrupt`` (barge-in)
and ``error``. One agent per session: a new ``hello`` for it replaces the previous agent. An agent
silent for ``zmq_dead_after_s`` (it should ``ping`` when it has nothing to say) is disconnected.

Many sessions, one endpoint: an ``AgentHub`` owns the socket and hands each message to its session
(``serve`` makes one and gives it to every session's ``ExternalAgent``). Each session has a secret
``token``; a ``hello`` carrying ``"session": token`` joins that session, a ``hello`` without one
joins the oldest session still waiting for an agent. An ``ExternalAgent`` given no hub makes one of
its own (one session).

Backpressure: the socket's receive queue is bounded (``RECEIVE_HWM``); each session's queue holds at
most ``SESSION_QUEUE`` messages and ``SESSION_QUEUE_BYTES``: an agent that runs further ahead of
its session (ingest paces speech to real time) gets an ``error`` for each message dropped (counted
in ``AgentHub.dropped``), and other sessions never wait for it.

Limits: a message part larger than ``MAX_MESSAGE_BYTES`` makes ZeroMQ drop the connection before it
is read (memory stays bounded: 256 × 1 MiB at most); an ``audio`` frame longer than
``MAX_FRAME_S`` is refused with an ``error`` (its resampling would hold the event loop). Off
loopback the socket is a CURVE server: ``zmq_curve_secret_key`` must be set and only agents whose
public keys are in ``zmq_curve_agents`` get through the handshake.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import anyio
import msgpack
import numpy as np
import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator

from charstream.stages.config import IngestConfig
from charstream.stages.ingest.adapters import (
    AgentAudioFrame,
    AgentDisconnected,
    AgentError,
    AgentEvent,
    AgentTurnEnd,
    AgentTurnStart,
    TurnRef,
    UserAudioFrame,
)
from charstream.stages.ingest.audio_input import MAX_CHANNELS, SUPPORTED_RATES, AudioFormatError, check_format
from charstream.timeline import TIMELINE_RATE
from charstream.transport.messages import TurnEvent, TurnKind
from charstream.transport.security import curve_required

PROTOCOL_VERSION = 1
FORMATS = {"s16le": np.dtype("<i2"), "f32le": np.dtype("<f4")}
RECEIVE_HWM = 256  # messages queued in the socket (~5 s of 20 ms frames)
SESSION_QUEUE = 512  # messages waiting for one session's ingest (~10 s of 20 ms frames)
SESSION_QUEUE_BYTES = 16 << 20
MAX_MESSAGE_BYTES = 1 << 20  # per message part: 1 s of 96 kHz stereo float32 is 768 KB
MAX_FRAME_S = 1.0  # audio per message; 20 ms is what the protocol recommends
POLL_S = 0.1


class ProtocolError(ValueError):
    """A message that breaks docs/AGENTS.md; the text is sent back to the agent."""


class AgentHub:
    """The agent socket of this process, shared by the sessions' ``ExternalAgent``s."""

    def __init__(self, config: IngestConfig | None = None, endpoint: str | None = None) -> None:
        self.config = config or IngestConfig()
        self.endpoint = endpoint or self.config.zmq_endpoint  # "tcp://127.0.0.1:0" binds a free port
        self._socket: zmq.asyncio.Socket | None = None
        self._auth: AsyncioAuthenticator | None = None
        self._reader: asyncio.Task | None = None
        self._sessions: dict[str, ExternalAgent] = {}  # by token, in registration order
        self._peers: dict[bytes, ExternalAgent] = {}  # agent connection -> its session
        self.bound_endpoint: str | None = None
        self.dropped = 0  # messages refused because their session's queue was full
        self.unrouted = 0  # messages for no session (unknown token, no hello, no session waiting)

    async def start(self) -> None:
        context = zmq.asyncio.Context.instance()
        socket = context.socket(zmq.ROUTER)
        socket.setsockopt(zmq.RCVHWM, RECEIVE_HWM)
        socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        socket.setsockopt(zmq.LINGER, 0)
        endpoint = self.endpoint[:-2] + ":*" if self.endpoint.endswith(":0") else self.endpoint
        secret = self.config.zmq_curve_secret_key
        if secret is None and curve_required(endpoint, force=False):
            socket.close(linger=0)
            raise PermissionError(f"agent endpoint {endpoint} is not loopback: set ingest.zmq_curve_secret_key "
                                  "(and zmq_curve_agents, the agents' public keys) so only known agents connect")
        if secret is not None:
            self._auth = AsyncioAuthenticator(context)
            self._auth.start()
            self._auth.configure_curve_callback("*", _AllowedAgents(self.config.zmq_curve_agents))
            socket.curve_server = True
            socket.curve_secretkey = secret.encode()
            socket.curve_publickey = zmq.curve_public(secret.encode())
        socket.bind(endpoint)
        self._socket = socket
        self.bound_endpoint = socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._reader = asyncio.get_running_loop().create_task(self._read(), name="agent-hub")

    def register(self, agent: ExternalAgent) -> None:
        self._sessions[agent.token] = agent

    def unregister(self, agent: ExternalAgent) -> None:
        self._sessions.pop(agent.token, None)
        for peer in [p for p, a in self._peers.items() if a is agent]:
            del self._peers[peer]

    async def _read(self) -> None:
        while True:
            frames = await self._socket.recv_multipart()
            peer, frames = frames[0], frames[1:]
            agent = self._route(peer, frames)
            if agent is None:
                continue
            size = sum(map(len, frames))
            if len(agent.inbox) >= SESSION_QUEUE or agent.inbox_bytes + size > SESSION_QUEUE_BYTES:
                self.dropped += 1
                await self.send(peer, {"type": "error", "detail": "message dropped: this session is "
                                       f"{len(agent.inbox)} messages behind (send speech at real-time pace)"})
                continue
            agent.deliver(peer, frames, size)

    def _route(self, peer: bytes, frames: list[bytes]) -> ExternalAgent | None:
        """The session a message is for: a hello's token (or the oldest session waiting for an
        agent), else the session the connection said hello to. None: answered with an error here."""
        try:
            header = msgpack.unpackb(frames[0], raw=False) if frames else None
        except Exception:  # garbage: the connection's session (if any) answers it
            header = None
        if isinstance(header, dict) and header.get("type") == "hello":
            token = header.get("session")
            if token is not None:
                agent = self._sessions.get(token) if isinstance(token, str) else None
                problem = None if agent is not None else "unknown session token"
            else:  # the connection's own session again, else the oldest one waiting for an agent
                agent = self._peers.get(peer) or next((a for a in self._sessions.values() if a.peer is None), None)
                problem = None if agent is not None else "no session is waiting for an agent"
            if agent is None:
                self.unrouted += 1
                asyncio.get_running_loop().create_task(self.send(peer, {"type": "error", "detail": problem}))
                return None
            previous = self._peers.get(peer)
            if previous is not None and previous is not agent:  # the connection moves to another session
                previous.deliver(peer, [msgpack.packb({"v": PROTOCOL_VERSION, "type": "bye"})], 0)
            self._peers[peer] = agent
            return agent
        agent = self._peers.get(peer)
        if agent is None:
            self.unrouted += 1
            asyncio.get_running_loop().create_task(self.send(peer, {"type": "error", "detail": (
                "say hello first (with your session token, or none to join a waiting session)")}))
        return agent

    async def send(self, peer: bytes, message: dict[str, Any]) -> None:
        if self._socket is None:
            return
        message["v"] = PROTOCOL_VERSION
        await self._socket.send_multipart([peer, msgpack.packb(message)])

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
            self._reader = None
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


class ExternalAgent:
    name = "zmq"

    def __init__(self, config: IngestConfig | None = None, session_id: str = "", endpoint: str | None = None,
                 hub: AgentHub | None = None) -> None:
        self.config = config or IngestConfig()
        self.session_id = session_id
        self.token = secrets.token_urlsafe(16)  # what an agent's hello names this session by
        self._hub = hub
        self._own_hub = hub is None  # made in start(), closed in close()
        self._endpoint = endpoint
        self.inbox: deque[tuple[bytes, list[bytes]]] = deque()  # filled by the hub, bounded there
        self.inbox_bytes = 0
        self._arrived = asyncio.Event()
        self.peer: bytes | None = None  # the agent connected to this session
        self._last_heard = 0.0
        if hub is not None:  # joinable from now: its agent's messages wait in the inbox until ingest reads
            hub.register(self)

    @property
    def bound_endpoint(self) -> str | None:
        return self._hub.bound_endpoint if self._hub is not None else None

    async def start(self) -> None:
        if self._own_hub:
            self._hub = AgentHub(self.config, self._endpoint)
            await self._hub.start()
            self._hub.register(self)

    def deliver(self, peer: bytes, frames: list[bytes], size: int) -> None:
        """A message for this session (called by the hub)."""
        self.inbox.append((peer, frames))
        self.inbox_bytes += size
        self._arrived.set()

    async def events(self) -> AsyncIterator[AgentEvent]:
        while True:
            if not self.inbox:
                self._arrived.clear()
                with anyio.move_on_after(POLL_S):
                    await self._arrived.wait()
            if self.inbox:
                peer, frames = self.inbox.popleft()
                self.inbox_bytes -= sum(map(len, frames))
                for event in await self._on_message(peer, frames):
                    yield event
            elif self.peer is not None and time.monotonic() - self._last_heard > self.config.zmq_dead_after_s:
                self.peer = None
                yield AgentDisconnected(f"agent silent for more than {self.config.zmq_dead_after_s} s")

    async def _on_message(self, peer: bytes, frames: list[bytes]) -> list[AgentEvent]:
        header: dict[str, Any] = {}
        try:
            header = _decode_header(frames)
            kind = header["type"]
            if kind == "hello":
                return await self._hello(peer, header)
            if peer != self.peer:
                raise ProtocolError(f"{kind!r} from an agent that has not said hello (or was replaced)")
            self._last_heard = time.monotonic()
            turn = _turn(header)
            if kind == "ping":
                await self._send(peer, {"type": "pong"})
                return []
            if kind == "turn_start":
                return [AgentTurnStart(turn)]
            if kind == "audio":
                return [_audio_frame(header, frames)]
            if kind == "turn_end":
                reason = header.get("reason", "done")
                if not isinstance(reason, str):
                    raise ProtocolError(f"'reason' must be a string, got {type(reason).__name__}")
                return [AgentTurnEnd(turn, reason[:64])]
            if kind == "bye":
                self.peer = None
                return [AgentDisconnected("agent said bye")]
            raise ProtocolError(f"unknown message type {kind!r}")
        except (ProtocolError, AudioFormatError) as e:
            turn = _turn_or_none(header)
            await self._send(peer, {"type": "error", "turn": turn, "detail": str(e)})
            return [AgentError(f"external agent: {e}", turn)]

    async def _hello(self, peer: bytes, header: dict[str, Any]) -> list[AgentEvent]:
        events: list[AgentEvent] = []
        if self.peer is not None and self.peer != peer:
            await self._send(self.peer, {"type": "error", "detail": "replaced by another agent's hello"})
            events.append(AgentDisconnected(f"replaced by agent {header.get('agent', '?')!r}"))
        self.peer, self._last_heard = peer, time.monotonic()
        await self._send(peer, {"type": "welcome", "timeline_rate": TIMELINE_RATE,
                                "rates": list(SUPPORTED_RATES), "formats": list(FORMATS),
                                "max_channels": MAX_CHANNELS, "dead_after_s": self.config.zmq_dead_after_s})
        return events

    async def hear(self, frame: UserAudioFrame) -> None:
        pass  # the protocol carries no user audio (version 1): the agent hears the user's turns only

    async def notify(self, event: TurnEvent) -> None:
        if event.kind in (TurnKind.USER_SPEECH_START, TurnKind.USER_SPEECH_END) and self.peer is not None:
            await self._send(self.peer, {"type": event.kind.value, "turn": event.turn_id, "at": event.at})

    async def interrupt(self, turn_ref: TurnRef) -> None:
        if self.peer is not None:
            await self._send(self.peer, {"type": "interrupt", "turn": turn_ref})

    async def _send(self, peer: bytes, message: dict[str, Any]) -> None:
        await self._hub.send(peer, message)

    async def close(self) -> None:
        if self._hub is None:
            return
        self._hub.unregister(self)
        if self._own_hub:
            await self._hub.close()
        self._hub = None


class _AllowedAgents:
    """ZAP credentials provider: only the configured agents' public keys (Z85) are let in."""

    def __init__(self, allowed: list[str]) -> None:
        self.allowed = {key.encode() for key in allowed}

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.allowed


def _decode_header(frames: list[bytes]) -> dict[str, Any]:
    if not frames:
        raise ProtocolError("empty message")
    try:
        header = msgpack.unpackb(frames[0], raw=False)
    except Exception as e:  # msgpack raises several types for garbage
        raise ProtocolError(f"frame 0 is not msgpack: {e}") from None
    if not isinstance(header, dict) or not isinstance(header.get("type"), str):
        raise ProtocolError("frame 0 must be a msgpack map with a string 'type'")
    version = header.get("v")
    if type(version) is not int or version != PROTOCOL_VERSION:  # True == 1 and 1.0 == 1 in Python
        raise ProtocolError(f"protocol version {header.get('v')!r} not supported (this is {PROTOCOL_VERSION})")
    return header


def _turn(header: dict[str, Any]) -> TurnRef:
    turn = header.get("turn")
    if turn is not None and (type(turn) is not int and not isinstance(turn, str)):
        raise ProtocolError(f"'turn' must be a string or an integer, got {type(turn).__name__} {turn!r:.80}")
    return turn


def _turn_or_none(header: dict[str, Any]) -> TurnRef:
    try:
        return _turn(header)
    except ProtocolError:
        return None


def _audio_frame(header: dict[str, Any], frames: list[bytes]) -> AgentAudioFrame:
    if len(frames) != 2:
        raise ProtocolError(f"'audio' needs exactly one payload frame after the header, got {len(frames) - 1}")
    fmt, rate, channels = header.get("format"), header.get("rate"), header.get("channels", 1)
    if not isinstance(fmt, str) or fmt not in FORMATS:
        raise ProtocolError(f"unsupported audio format {fmt!r:.80}; supported: {list(FORMATS)}")
    if type(rate) is not int or type(channels) is not int:  # not bool: True is an int in Python
        raise ProtocolError(f"'rate' and 'channels' must be integers, got {rate!r:.80} and {channels!r:.80}")
    dtype = FORMATS[fmt]
    check_format(rate, dtype.newbyteorder("=").name, channels)
    payload = frames[1]
    if len(payload) % (dtype.itemsize * channels):
        raise ProtocolError(f"payload of {len(payload)} bytes is not a whole number of {channels}-channel {fmt} frames")
    seconds = len(payload) / (dtype.itemsize * channels * rate)
    if seconds > MAX_FRAME_S:
        raise ProtocolError(f"audio frame of {seconds:.2f} s: at most {MAX_FRAME_S} s per message (20 ms recommended)")
    samples = np.frombuffer(payload, dtype).astype(dtype.newbyteorder("="))
    if samples.dtype.kind == "f" and not (finite := np.isfinite(samples)).all():  # a broken agent: say so
        raise ProtocolError(f"audio frame has {int((~finite).sum())} non-finite samples (NaN/inf)")
    return AgentAudioFrame(samples, rate, channels, _turn(header))
