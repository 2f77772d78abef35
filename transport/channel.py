"""ZeroMQ channels with credit-based backpressure, and the control bus that overtakes data.

Data edge = one ``Receiver`` (ROUTER, binds) and its ``Sender`` (DEALER, connects, identity = the
sending stage). The sender says HELLO; the receiver grants ``capacity`` credits; every data message
spends one; the receiver returns one when its consumer *takes* the message. So at most ``capacity``
messages are ever between producer and consumer (in ZeroMQ queues, kernel buffers or the receiver's
queue), whatever the consumer's speed: ZeroMQ's high-water marks never come into play.

Frames on the wire (after the ROUTER's identity frame): ``[kind, *payload]`` with kind one of
HELLO (payload on ipc: the sender's slot geometry, see ``transport.slots``), CREDIT (payload:
count, 4 bytes), BEAT (heartbeat), BYE, DATA (payload: codec frames), SLOT (DATA whose arrays wait
in a shared-memory slot; payload: slot reference, codec header), CTRL (control bus: codec frames of
a ``Control``), GO (control bus: every stage is ready).

A bad DATA message (see ``transport.codec``) is counted and logged, and its credit is returned: the
channel keeps working and nothing valid is lost. Heartbeats run both ways every ``heartbeat_s``;
a peer silent for ``dead_after_s`` (after first contact, ipc/tcp only: inproc peers share our fate)
makes ``send``/``take`` raise ``PeerDeadError``. A connecting end whose CURVE keys the binding end
refuses fails at once (``ChannelError``), since ZeroMQ never retries that handshake.

The control bus: a ``ControlHub`` (ROUTER) in the session's parent and one ``ControlClient`` per
stage. A client's message is broadcast to every other registered client and to the hub's owner.
"""

from __future__ import annotations

import collections
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.abc
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from charstream.logs import LogLimit, get_logger
from charstream.transport.codec import MessageError, decode, encode
from charstream.transport.config import TransportConfig
from charstream.transport.messages import Control, Message
from charstream.transport.security import CurveKeys, Security
from charstream.transport.slots import SlotBlock, SlotError, SlotView, peer_pid

HELLO, CREDIT, BEAT, BYE, DATA, SLOT, CTRL, GO = b"H", b"C", b"B", b"X", b"D", b"S", b"K", b"G"
SEND_LINGER_MS = 200  # lets a closing sender flush what it already sent, without hanging on a dead peer
CONTROL_QUEUE = 1024  # control is rare; past this a stage is not reading its control at all


def free_tcp_port(host: str) -> int:
    """A port that was free a moment ago (for endpoints that must be known before the peer binds)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


class ChannelError(RuntimeError):
    """A channel-level failure (dead peer, protocol misuse), naming the channel and the peer."""

    def __init__(self, problem: str, channel: str, peer: str = "?") -> None:
        super().__init__(f"channel {channel!r}, peer {peer!r}: {problem}")
        self.problem = problem
        self.channel = channel
        self.peer = peer

    def __reduce__(self):  # pickled by its fields: it crosses processes (a spawned consumer's result)
        return type(self), (self.problem, self.channel, self.peer)


class PeerDeadError(ChannelError):
    """The peer missed heartbeats for ``dead_after_s``."""


@dataclass
class ChannelStats:
    sent: int = 0
    received: int = 0
    bad: int = 0  # malformed, invalid or over-credit messages (dropped, counted, logged)
    errors: int = 0  # of those, the ones that raised something other than a clear error: a bug, logged with its traceback
    max_in_flight: int = 0  # sender side: sent minus credits returned, at its peak
    slotted: int = 0  # messages whose arrays crossed in a shared-memory slot (ipc)
    last_error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


class Transport:
    """One process's ZeroMQ context, CURVE policy and transport config, shared by its channels."""

    def __init__(self, config: TransportConfig, keys: CurveKeys | None = None) -> None:
        self.config = config
        self.ctx = zmq.asyncio.Context()
        self.security = Security(self.ctx, keys, config.curve)

    def close(self) -> None:
        self.security.close()
        self.ctx.destroy(linger=0)


class Wakeup:
    """Wakes one waiting task when any of the channels sharing it has news (single event loop)."""

    def __init__(self) -> None:
        self._event = anyio.Event()

    def arm(self) -> anyio.Event:
        """A fresh event to wait on; arm *before* checking the queues, then wait if they were empty."""
        self._event = anyio.Event()
        return self._event

    def notify(self) -> None:
        self._event.set()


class _Liveness:
    """Last-heard times of peers; a peer silent for ``dead_after`` is dead.

    If our own event loop stalled (the heartbeat tick itself came late), every peer gets the benefit
    of the doubt: we could not have heard them.
    """

    def __init__(self, dead_after: float, enabled: bool) -> None:
        self.dead_after = dead_after
        self.enabled = enabled
        self.last_seen: dict[bytes, float] = {}
        self._last_tick = time.monotonic()

    def seen(self, peer: bytes) -> None:
        self.last_seen[peer] = time.monotonic()

    def forget(self, peer: bytes) -> None:
        self.last_seen.pop(peer, None)

    def dead(self) -> list[bytes]:
        now = time.monotonic()
        if now - self._last_tick > self.dead_after / 2:
            self.last_seen = dict.fromkeys(self.last_seen, now)
        self._last_tick = now
        if not self.enabled:
            return []
        return [p for p, t in self.last_seen.items() if now - t > self.dead_after]


class _Endpoint:
    """Socket + task group + heartbeat loop shared by every channel end (an async context manager)."""

    socket_type: int = zmq.ROUTER

    def __init__(self, transport: Transport, endpoint: str, name: str, wakeup: Wakeup | None) -> None:
        self.transport = transport
        self.endpoint = endpoint
        self.name = name
        self.wakeup = wakeup or Wakeup()
        self.stats = ChannelStats()
        self.error: ChannelError | None = None
        self.live = _Liveness(transport.config.dead_after_s, not endpoint.startswith("inproc://"))
        self.log = get_logger(channel=name, endpoint=endpoint)
        self._log_limit = LogLimit()  # a peer sending garbage logs a few lines and a count
        self.sock: zmq.asyncio.Socket | None = None
        self._tg: anyio.abc.TaskGroup | None = None

    def _open(self, sock: zmq.asyncio.Socket) -> None:
        raise NotImplementedError

    async def _on_frames(self, frames: list[zmq.Frame]) -> None:
        raise NotImplementedError

    async def _beat(self) -> None:
        raise NotImplementedError

    def _forget_dead(self, peer: bytes) -> None:
        """Release what a peer declared dead held (nothing, unless a subclass holds something)."""

    def _fail(self, error: ChannelError) -> None:
        if self.error is None:
            self.error = error
            self.log.error("channel_failed", error=str(error))
        self.wakeup.notify()

    def _count_bad(self, error: Exception) -> None:
        self.stats.bad += 1
        self.stats.last_error = str(error)
        self._log_limit(self.log.warning, "bad_message", error=str(error)[:300], bad=self.stats.bad)

    async def __aenter__(self):
        self.sock = self.transport.ctx.socket(self.socket_type)
        self.sock.linger = 0
        self.sock.reconnect_ivl = 20  # ms: a peer that binds late (a process still starting) is found fast
        self._open(self.sock)
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        self._tg.start_soon(self._pump)
        self._tg.start_soon(self._heartbeat)
        if self.socket_type == zmq.DEALER and self.sock.mechanism == zmq.CURVE:  # only CURVE's keys are refused
            self._tg.start_soon(self._watch_handshakes)
        return self

    async def __aexit__(self, *exc_info) -> bool:
        self._tg.cancel_scope.cancel()
        await self._tg.__aexit__(None, None, None)
        self._close()
        return False

    def _close(self) -> None:
        self.sock.close()

    async def _pump(self) -> None:
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            try:
                await self._on_frames(frames)
            except (zmq.ZMQError, anyio.get_cancelled_exc_class()):
                raise
            except Exception as e:  # our bug, triggered by a peer's message: one message lost, not the channel
                self.stats.errors += 1
                self.log.exception("message_handling_failed", frames=len(frames))
                self._count_bad(e)

    async def _watch_handshakes(self) -> None:
        """A connecting end whose keys the peer's authenticator refused is never connected again (ZeroMQ
        does not retry a refused handshake): fail the channel saying so, rather than wait for credit forever."""
        monitor = self.sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_FAILED_AUTH)
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())
                self._fail(ChannelError(f"the peer refused this end's CURVE keys (ZAP status {event['value']})",
                                        self.name, self.endpoint))
        finally:
            self.sock.disable_monitor()
            monitor.close(linger=0)

    async def _heartbeat(self) -> None:
        while True:
            await anyio.sleep(self.transport.config.heartbeat_s)
            await self._beat()
            for peer in self.live.dead():
                self.live.forget(peer)
                self._forget_dead(peer)
                self._fail(PeerDeadError(
                    f"no heartbeat for {self.live.dead_after:.2f} s", self.name, peer.decode(errors="replace")
                ))


def _bind(end: _Endpoint, sock: zmq.asyncio.Socket) -> None:
    # Last-resort guard against a hostile peer's giant frame: ZeroMQ drops that connection before
    # allocating it. Frames merely over max_message_bytes still arrive and are counted as bad.
    sock.maxmsgsize = 2 * end.transport.config.max_message_bytes
    end.transport.security.server(sock, end.endpoint)
    sock.bind(end.endpoint)
    if end.endpoint.endswith(":*"):  # tcp port chosen by the OS: publish the real endpoint
        end.endpoint = sock.last_endpoint.decode()


def _sender_pid(frame: zmq.Frame) -> int | None:
    """The sending process's pid, as the kernel gave it to ZeroMQ for this ipc connection."""
    try:
        return peer_pid(frame.get("Peer-Address"))
    except zmq.ZMQError:  # no such property on this transport
        return None


class Receiver(_Endpoint):
    """The receiving end of a data edge: binds, grants credits, validates and queues messages."""

    def __init__(
        self, transport: Transport, endpoint: str, name: str, capacity: int, wakeup: Wakeup | None = None
    ) -> None:
        super().__init__(transport, endpoint, name, wakeup)
        self.capacity = capacity
        self._queue: collections.deque[tuple[bytes, Message]] = collections.deque()
        self._credit_out: dict[bytes, int] = {}  # credits each peer holds and has not spent
        self._queued: collections.Counter[bytes] = collections.Counter()
        self._blocks: dict[bytes, SlotView] = {}  # each ipc sender's shared-memory slots
        self.last_taken_at = 0.0

    def _open(self, sock: zmq.asyncio.Socket) -> None:
        _bind(self, sock)

    async def _grant(self, peer: bytes, count: int) -> None:
        if count > 0:
            self._credit_out[peer] += count
            await self.sock.send_multipart([peer, CREDIT, count.to_bytes(4, "little")])

    def _codec_frames(self, peer: bytes, kind: bytes, payload: list[zmq.Frame]) -> list[Any]:
        """The codec frames of a DATA or SLOT message. A SLOT's arrays are copied out of the sender's
        block right here, on arrival and in order, so a slot is free before its credit returns."""
        if kind == DATA:
            return payload
        block = self._blocks.get(peer)
        if block is None or len(payload) != 2:
            raise SlotError("slot message without a shared-memory block" if block is None
                            else f"slot message of {len(payload)} frames, expected 2")
        return [payload[1], *block.read(payload[0].bytes)]

    def _release(self, peer: bytes) -> None:
        block = self._blocks.pop(peer, None)
        if block is not None:
            block.close()

    def _forget_dead(self, peer: bytes) -> None:
        self._release(peer)  # our mapping was the last of a killed sender's block

    def _close(self) -> None:
        for peer in list(self._blocks):  # senders that never said BYE: maybe killed before detection
            self._release(peer)
        super()._close()

    async def _on_frames(self, frames: list[zmq.Frame]) -> None:
        peer, kind = frames[0].bytes, frames[1].bytes if len(frames) > 1 else b""
        known = peer in self._credit_out
        name = peer.decode(errors="replace")
        if known:
            self.live.seen(peer)
        if kind in (DATA, SLOT) and known:
            if self._credit_out[peer] <= 0:
                self._count_bad(ChannelError("data message without credit (dropped)", self.name, name))
                return
            self._credit_out[peer] -= 1
            try:
                payload = self._codec_frames(peer, kind, frames[2:])
                msg = decode(payload, self.transport.config.max_message_bytes, self.name, name)
            except (MessageError, SlotError) as e:
                self._count_bad(e if isinstance(e, MessageError) else MessageError(str(e), self.name, name))
                await self._grant(peer, 1)  # the bad message spent a credit; give it back
                return
            self._queue.append((peer, msg))
            self._queued[peer] += 1
            self.stats.received += 1
            self.stats.slotted += kind == SLOT
            self.wakeup.notify()
        elif kind == HELLO:
            try:
                # Receive buffers: up to capacity queued, the one the consumer works on, the one arriving.
                block = SlotView(frames[2].bytes, self.transport.config.max_message_bytes,
                                 _sender_pid(frames[2]), self.capacity + 2) if len(frames) > 2 else None
            except SlotError as e:
                self._count_bad(ChannelError(f"hello refused: {e}", self.name, name))
                return
            self._release(peer)  # a restarted sender's old block
            if block is not None:
                self._blocks[peer] = block
            # A new (or restarted) sender holds no credit: grant what its queued messages leave free.
            self._credit_out[peer] = 0
            self.live.seen(peer)
            await self._grant(peer, self.capacity - self._queued[peer])
        elif kind == BYE and known:
            del self._credit_out[peer]
            self.live.forget(peer)
            self._release(peer)
        elif kind != BEAT or not known:
            problem = f"unexpected frame kind {kind[:8]!r}" if known else "message from a peer that never said hello"
            self._count_bad(ChannelError(f"{problem} ({len(frames) - 1} frames dropped)", self.name, name))

    async def _beat(self) -> None:
        for peer in self._credit_out:
            await self.sock.send_multipart([peer, BEAT])

    async def take(self) -> Message | None:
        """The next message if one is queued (returning its credit to the sender), else None."""
        if self.error is not None:
            raise self.error
        if not self._queue:
            return None
        peer, msg = self._queue.popleft()
        self._queued[peer] -= 1
        self.last_taken_at = time.monotonic()  # before the credit leaves: the sender cannot reuse it earlier
        if peer in self._credit_out:
            await self._grant(peer, 1)
        return msg

    async def recv(self) -> Message:
        """Wait for the next message."""
        while True:
            event = self.wakeup.arm()
            msg = await self.take()
            if msg is not None:
                return msg
            await event.wait()

    def pending(self) -> int:
        return len(self._queue)


class Sender(_Endpoint):
    """The sending end of a data edge: connects, spends one credit per message, awaits when out.

    On ipc, large arrays travel in a ring of ``capacity`` shared-memory slots (``transport.slots``):
    credits keep at most ``capacity`` messages in flight, so the ring never runs over. ``capacity``
    is the edge's (the receiver's); None: TransportConfig's for this edge name. A smaller ring than
    the receiver's capacity stays correct: messages that find their slot still busy go inline.
    """

    socket_type = zmq.DEALER

    def __init__(self, transport: Transport, endpoint: str, name: str, identity: str, capacity: int | None = None) -> None:
        super().__init__(transport, endpoint, name, None)
        self.identity = identity
        self.peer = name.split("->")[-1]
        config = transport.config
        self.capacity = capacity or config.capacities.get(name, config.default_capacity)
        self.credits = 0
        self._granted = False  # the first CREDIT is the initial grant; later ones return taken messages
        self._taken = 0
        self.block: SlotBlock | None = None
        self._next_slot = 0
        self._slot_user: list[int] = []  # per slot, the index of the last message written to it

    def _open(self, sock: zmq.asyncio.Socket) -> None:
        sock.routing_id = self.identity.encode()
        sock.sndhwm = 0  # credits bound what is queued; a HWM would only add a second, silent limit
        self.transport.security.client(sock, self.endpoint)
        sock.connect(self.endpoint)

    async def __aenter__(self):
        config = self.transport.config
        if self.endpoint.startswith("ipc://") and config.slot_bytes > 0:
            # No message exceeds max_message_bytes, and receivers refuse larger slots.
            self.block = SlotBlock(self.capacity, min(config.slot_bytes, config.max_message_bytes))
            self._slot_user = [-1] * self.capacity
        await super().__aenter__()
        await self.sock.send_multipart([HELLO, self.block.geometry()] if self.block else [HELLO])
        return self

    def _close(self) -> None:
        if self.error is None:
            self.sock.send(BYE, flags=zmq.NOBLOCK)
        self.sock.close(linger=SEND_LINGER_MS)
        if self.block is not None:
            self.block.close()  # a receiver that mapped it keeps its mapping until it releases it

    async def _on_frames(self, frames: list[zmq.Frame]) -> None:
        self.live.seen(self.peer.encode())
        kind = frames[0].bytes
        if kind == CREDIT and len(frames) == 2 and len(frames[1].bytes) == 4:
            count = int.from_bytes(frames[1].bytes, "little")
            self.credits += count
            if self._granted:
                self._taken += count
            self._granted = True
            self.wakeup.notify()
        elif kind != BEAT:
            self._count_bad(ChannelError(f"unexpected frame kind {kind[:8]!r} from the receiver", self.name, self.peer))

    async def _beat(self) -> None:
        await self.sock.send(BEAT)

    async def ready(self) -> None:
        """Wait until a ``send`` would not block (a credit is available). Raises on a dead peer."""
        while self.credits <= 0:
            if self.error is not None:
                raise self.error
            event = self.wakeup.arm()
            if self.credits <= 0 and self.error is None:
                await event.wait()
        if self.error is not None:
            raise self.error

    async def send(self, msg: Message) -> None:
        """Encode and send ``msg``; awaits a credit first (backpressure). Raises on a dead peer."""
        frames = encode(msg, self.transport.config.max_message_bytes)
        await self.ready()
        self.credits -= 1
        await self.sock.send_multipart(self._in_slot(frames) or [DATA, *frames], copy=False)
        self.stats.sent += 1
        self.stats.max_in_flight = max(self.stats.max_in_flight, self.in_flight)

    def _in_slot(self, frames: list[Any]) -> list[Any] | None:
        """``[SLOT, reference, header]`` once the arrays are copied into the next slot; None: inline
        (no block, too small to gain, larger than a slot, slot still busy or tmpfs full)."""
        size = sum(b.nbytes for b in frames[1:])
        if self.block is None or not self.transport.config.slot_min_bytes <= size <= self.block.slot_bytes:
            return None
        slot = self._next_slot
        # The receiver copies each message out when it arrives, in order, before that message's
        # credit can return: with _taken credits back, messages 0.._taken-1 have left their slots.
        if self._slot_user[slot] >= self._taken:
            return None
        ref = self.block.write(slot, frames[1:])
        if ref is None:
            return None
        self._slot_user[slot] = self.stats.sent
        self._next_slot = (slot + 1) % self.block.slots
        self.stats.slotted += 1
        return [SLOT, ref, frames[0]]

    @property
    def in_flight(self) -> int:
        """Messages sent and not yet taken (or dropped as bad) by the receiver."""
        return self.stats.sent - self._taken


class ControlHub(_Endpoint):
    """The session's control bus: registers stage clients, broadcasts control, watches liveness."""

    def __init__(
        self,
        transport: Transport,
        endpoint: str,
        expected: set[str],
        on_control: Callable[[Control, str], None],
        on_dead: Callable[[str], None],
    ) -> None:
        super().__init__(transport, endpoint, "control", None)
        self.expected = expected
        self.on_control = on_control
        self.on_dead = on_dead
        self.registered: set[bytes] = set()
        self.started = anyio.Event()

    def _open(self, sock: zmq.asyncio.Socket) -> None:
        _bind(self, sock)

    async def _on_frames(self, frames: list[zmq.Frame]) -> None:
        peer, kind = frames[0].bytes, frames[1].bytes if len(frames) > 1 else b""
        name = peer.decode(errors="replace")
        if kind == HELLO:
            self.registered.add(peer)
            self.live.seen(peer)
            if not self.started.is_set() and {p.decode() for p in self.registered} >= self.expected:
                for p in self.registered:
                    await self.sock.send_multipart([p, GO])
                self.started.set()
            elif self.started.is_set():
                await self.sock.send_multipart([peer, GO])
            return
        if peer not in self.registered:
            self._count_bad(ChannelError("message from an unregistered client", self.name, name))
            return
        self.live.seen(peer)
        if kind == CTRL:
            try:
                msg = decode(frames[2:], self.transport.config.max_message_bytes, self.name, name)
                if not isinstance(msg, Control):
                    raise MessageError(f"{type(msg).__name__} on the control bus", self.name, name)
            except MessageError as e:
                self._count_bad(e)
                return
            for p in self.registered - {peer}:
                await self.sock.send_multipart([p, CTRL, *frames[2:]], copy=False)
            self.stats.received += 1
            self.on_control(msg, name)
        elif kind == BYE:
            self.registered.discard(peer)
            self.live.forget(peer)
        elif kind != BEAT:
            self._count_bad(ChannelError(f"unexpected frame kind {kind[:8]!r}", self.name, name))

    async def _beat(self) -> None:
        for p in self.registered:
            await self.sock.send_multipart([p, BEAT])

    def _fail(self, error: ChannelError) -> None:
        # A silent stage is the session's problem, not the bus's: report it and keep serving the rest.
        self.log.error("stage_silent", error=str(error))
        self.on_dead(error.peer)

    async def broadcast(self, msg: Control) -> None:
        frames = encode(msg, self.transport.config.max_message_bytes)
        for p in self.registered:
            await self.sock.send_multipart([p, CTRL, *frames], copy=False)
        self.stats.sent += 1


class ControlClient(_Endpoint):
    """A stage's end of the control bus: sends control, queues what others broadcast."""

    socket_type = zmq.DEALER

    def __init__(self, transport: Transport, endpoint: str, stage: str, wakeup: Wakeup | None = None) -> None:
        super().__init__(transport, endpoint, f"control:{stage}", wakeup)
        self.stage = stage
        self.started = anyio.Event()
        self._queue: collections.deque[Control] = collections.deque()
        self._registered = False

    def _open(self, sock: zmq.asyncio.Socket) -> None:
        sock.routing_id = self.stage.encode()
        self.transport.security.client(sock, self.endpoint)
        sock.connect(self.endpoint)

    def _close(self) -> None:
        if self._registered and self.error is None:
            self.sock.send(BYE, flags=zmq.NOBLOCK)
        self.sock.close(linger=SEND_LINGER_MS)

    async def register(self) -> None:
        """Tell the hub this stage is ready; ``started`` is set once every stage of the session is.
        Raises if the hub refused this end: a socket refused has no peer left to queue for."""
        if self.error is not None:
            raise self.error
        try:
            await self.sock.send(HELLO, zmq.NOBLOCK)
        except zmq.Again:
            raise ChannelError("no connection to the hub to register on (it refused this end)", self.name, "hub") from None
        self._registered = True

    async def _on_frames(self, frames: list[zmq.Frame]) -> None:
        self.live.seen(b"hub")
        kind = frames[0].bytes
        if kind == CTRL:
            try:
                msg = decode(frames[1:], self.transport.config.max_message_bytes, self.name, "hub")
            except MessageError as e:
                self._count_bad(e)
                return
            if len(self._queue) >= CONTROL_QUEUE:
                self._count_bad(ChannelError("control queue full: message dropped", self.name, "hub"))
                return
            self._queue.append(msg)
            self.stats.received += 1
            self.wakeup.notify()
        elif kind == GO:
            self.started.set()
        elif kind != BEAT:
            self._count_bad(ChannelError(f"unexpected frame kind {kind[:8]!r}", self.name, "hub"))

    async def _beat(self) -> None:
        if self._registered:
            await self.sock.send(BEAT)

    async def send(self, msg: Control) -> None:
        await self.sock.send_multipart([CTRL, *encode(msg, self.transport.config.max_message_bytes)], copy=False)
        self.stats.sent += 1

    def take(self) -> Control | None:
        if self.error is not None:
            raise self.error
        return self._queue.popleft() if self._queue else None
