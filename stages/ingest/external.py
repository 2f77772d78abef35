"""External agent over ZeroMQ: any process that speaks the msgpack protocol of docs/AGENTS.md drives
charstream (``IngestConfig.adapter = "zmq"``).

charstream binds a ROUTER at ``IngestConfig.zmq_endpoint``; the agent connects a DEALER, says
``hello``, then sends ``turn_start`` / ``audio`` (+ one raw PCM frame) / ``turn_end``; charstream sends
back ``welcome``, ``user_speech_start`` / ``user_speech_end`` (from its VAD), ``interrupt`` (barge-in)
and ``error``. One agent at a time: a new ``hello`` replaces the previous agent. An agent silent for
``zmq_dead_after_s`` (it should ``ping`` when it has nothing to say) is disconnected.

Backpressure: the socket is read only when ingest asks for the next event, and its receive queue is
bounded (``RECEIVE_HWM``), so an agent sending faster than ingest takes blocks in its own ``send``.

Limits: a message part larger than ``MAX_MESSAGE_BYTES`` makes ZeroMQ drop the connection before it
is read (memory stays bounded: 256 × 1 MiB at most); an ``audio`` frame longer than
``MAX_FRAME_S`` is refused with an ``error`` (its resampling would hold the event loop). Off
loopback the socket is a CURVE server: ``zmq_curve_secret_key`` must be set and only agents whose
public keys are in ``zmq_curve_agents`` get through the handshake.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import numpy as np
import zmq
import zmq.asyncio
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
from charstream.transport.messages import TurnEvent, TurnKind
from charstream.transport.security import curve_required
from zmq.auth.asyncio import AsyncioAuthenticator

from charstream.timeline import TIMELINE_RATE

PROTOCOL_VERSION = 1
FORMATS = {"s16le": np.dtype("<i2"), "f32le": np.dtype("<f4")}
RECEIVE_HWM = 256  # messages queued in the socket (~5 s of 20 ms frames)
MAX_MESSAGE_BYTES = 1 << 20  # per message part: 1 s of 96 kHz stereo float32 is 768 KB
MAX_FRAME_S = 1.0  # audio per message; 20 ms is what the protocol recommends
POLL_S = 0.1


class ProtocolError(ValueError):
    """A message that breaks docs/AGENTS.md; the text is sent back to the agent."""


class ExternalAgent:
    name = "zmq"

    def __init__(self, config: IngestConfig | None = None, session_id: str = "", endpoint: str | None = None) -> None:
        self.config = config or IngestConfig()
        self.endpoint = endpoint or self.config.zmq_endpoint  # "tcp://127.0.0.1:0" binds a free port
        self._socket: zmq.asyncio.Socket | None = None
        self._peer: bytes | None = None
        self._last_heard = 0.0
        self._auth: AsyncioAuthenticator | None = None
        self.bound_endpoint: str | None = None

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

    async def events(self) -> AsyncIterator[AgentEvent]:
        socket = self._socket
        while True:
            if await socket.poll(POLL_S * 1000, zmq.POLLIN):
                frames = await socket.recv_multipart()
                for event in await self._on_message(frames[0], frames[1:]):
                    yield event
            elif self._peer is not None and time.monotonic() - self._last_heard > self.config.zmq_dead_after_s:
                self._peer = None
                yield AgentDisconnected(f"agent silent for more than {self.config.zmq_dead_after_s} s")

    async def _on_message(self, peer: bytes, frames: list[bytes]) -> list[AgentEvent]:
        header: dict[str, Any] = {}
        try:
            header = _decode_header(frames)
            kind = header["type"]
            if kind == "hello":
                return await self._hello(peer, header)
            if peer != self._peer:
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
                self._peer = None
                return [AgentDisconnected("agent said bye")]
            raise ProtocolError(f"unknown message type {kind!r}")
        except (ProtocolError, AudioFormatError) as e:
            turn = _turn_or_none(header)
            await self._send(peer, {"type": "error", "turn": turn, "detail": str(e)})
            return [AgentError(f"external agent: {e}", turn)]

    async def _hello(self, peer: bytes, header: dict[str, Any]) -> list[AgentEvent]:
        events: list[AgentEvent] = []
        if self._peer is not None and self._peer != peer:
            await self._send(self._peer, {"type": "error", "detail": "replaced by another agent's hello"})
            events.append(AgentDisconnected(f"replaced by agent {header.get('agent', '?')!r}"))
        self._peer, self._last_heard = peer, time.monotonic()
        await self._send(peer, {"type": "welcome", "timeline_rate": TIMELINE_RATE,
                                "rates": list(SUPPORTED_RATES), "formats": list(FORMATS),
                                "max_channels": MAX_CHANNELS, "dead_after_s": self.config.zmq_dead_after_s})
        return events

    async def hear(self, frame: UserAudioFrame) -> None:
        pass  # the protocol carries no user audio (version 1): the agent hears the user's turns only

    async def notify(self, event: TurnEvent) -> None:
        if event.kind in (TurnKind.USER_SPEECH_START, TurnKind.USER_SPEECH_END) and self._peer is not None:
            await self._send(self._peer, {"type": event.kind.value, "turn": event.turn_id, "at": event.at})

    async def interrupt(self, turn_ref: TurnRef) -> None:
        if self._peer is not None:
            await self._send(self._peer, {"type": "interrupt", "turn": turn_ref})

    async def _send(self, peer: bytes, message: dict[str, Any]) -> None:
        message["v"] = PROTOCOL_VERSION
        await self._socket.send_multipart([peer, msgpack.packb(message)])

    async def close(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None


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
    return AgentAudioFrame(samples, rate, channels, _turn(header))
