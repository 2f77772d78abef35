"""Egress as a stage of the session graph: the node that ties the session's life to its peer's.

The browser's peer connection is made by the signaling server (``server.py``: offer, answer, tracks
reading playout's ``PlayoutOutput``, the data channel); the session it belongs to is a graph run by
the runner. ``PeerLink`` joins the two, and ``EgressStage`` is the graph's end of it:

- while the session runs, the stage pings the client over the data channel (clock offset and
  liveness); a client that stops answering, a failed or closed connection, or a hangup ends the
  session with ``Control(SHUTDOWN)`` — the same way any stage ends it;
- when the session ends for any other reason (a failed stage, a stop), whoever ran the session
  ends the link with the session's result (``PeerLink.end``): the page is told why and its peer
  connection closed.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio

from charstream.stages.base import Stage, StageContext
from charstream.stages.config import EgressConfig
from charstream.transport.messages import Control, ControlKind, Message, ShutdownPayload

EndPeer = Callable[[str], Awaitable[None]]  # tell the page why, then close its peer connection


class PeerLink:
    """One session's peer connection as its egress stage sees it. The server attaches ``send`` and
    ``end_peer`` when the connection is made and reports what the peer does (``heard``, ``closed``);
    the egress stage reports a peer that vanished (``peer_gone``) and ends it (``end``)."""

    def __init__(self) -> None:
        self.gone = anyio.Event()
        self.reason = ""
        self.last_heard = time.monotonic()
        self._send: Callable[[dict[str, Any]], None] | None = None
        self._end_peer: EndPeer | None = None
        self._peer_closed = False
        self._ended = False

    def attach(self, send: Callable[[dict[str, Any]], None], end_peer: EndPeer) -> None:
        self._send, self._end_peer = send, end_peer
        self.last_heard = time.monotonic()

    def heard(self) -> None:
        self.last_heard = time.monotonic()

    def send(self, msg: dict[str, Any]) -> None:
        if self._send is not None:
            self._send(msg)

    def peer_gone(self, reason: str) -> None:
        if not self.gone.is_set():
            self.reason = reason
            self.gone.set()

    def closed(self, reason: str) -> None:
        """The server closed the peer connection (it failed, closed, hung up, or the server stops)."""
        self._peer_closed = True
        self.peer_gone(reason)

    async def end(self, reason: str) -> None:
        """The session ended: tell the page (once) and close the peer connection."""
        if self._ended:
            return
        self._ended = True
        if self._end_peer is not None and not self._peer_closed:
            await self._end_peer(reason)


class EgressStage(Stage):
    """The session graph's egress node (group ``main``, beside the event loop's WebRTC)."""

    name = "egress"

    def __init__(self, config: EgressConfig, link: PeerLink) -> None:
        self.config = config
        self.link = link
        self.pings = 0

    async def run(self, ctx: StageContext) -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._keepalive)
            await self.link.gone.wait()
            tg.cancel_scope.cancel()
        ctx.log.info("peer_gone", reason=self.link.reason)
        await ctx.send_control(Control(ctx.session_id, 0, ControlKind.SHUTDOWN, payload=ShutdownPayload(self.link.reason)))

    async def _keepalive(self) -> None:
        config = self.config
        asked = time.monotonic()  # silence counts from the first ping: the session's setup is not the client's
        while True:
            # A few quick pings first: the clock offset is needed from the first frame report.
            await anyio.sleep(config.ping_interval_s if self.pings > 5 else min(0.1, config.ping_interval_s))
            self.pings += 1
            self.link.send({"type": "ping", "id": self.pings, "server_ms": time.time() * 1e3})
            if time.monotonic() - max(self.link.last_heard, asked) > config.client_timeout_s:
                self.link.peer_gone("client vanished (no data-channel reply)")
                return

    async def process(self, msg: Message, ctx: StageContext) -> None:
        raise ValueError(f"egress has no data input (its tracks read playout's output); got {type(msg).__name__}")
