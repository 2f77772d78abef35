"""The WebRTC egress server: aiohttp signaling + one aiortc peer connection per session.

HTTP API (JSON; errors are ``{"error": "..."}`` with a 4xx/5xx status):

* ``GET /`` — the web page (``static/``).
* ``POST /code`` with ``{"code"}`` → ``{"key"}``: trades a one-time code (``issue_code``; the
  link ``serve`` prints) for the server key, so the key itself never travels in a URL (history,
  scrollback, proxy logs). A code works once.
* ``POST /session`` with header ``X-Charstream-Key: <server key>`` → ``{"session_id", "token"}``:
  reserves a session; the token admits exactly one offer, within ``offer_timeout_s``. Each client
  address holds at most ``sessions_per_client`` live sessions (reserved or connected), of them at
  most ``reservations_per_client`` without an offer, and makes at most ``reservations_per_minute``
  (429 past any), so one key holder cannot take every slot while ``sessions_per_client`` is below
  ``max_sessions``.
* ``POST /offer`` with ``{"token", "sdp", "type": "offer"}`` → the SDP answer. A wrong token is
  403, a token already used (replayed offer) 409, a malformed body or SDP 400 (so is an offer
  listing more than ``max_offer_candidates`` ICE candidates: the server would check connectivity
  to each, or an SDP over ``MAX_SDP_CHARS``), too many sessions 503. The offer is parsed off the event loop. On success the session
  factory builds the session's media (``SessionMedia``).
* ``POST /hangup`` with ``{"token"}`` — closes the session.

Each session is a graph run by the runner whose egress node (``stage.EgressStage``) holds the
session's end of a ``PeerLink``: the node pings the client over the data channel, and the session
ends when the peer connection fails or closes, when the client stops answering pings for
``client_timeout_s`` (it vanished), on hangup, or on server stop; when the session ends first (a
stage failed), the node tells the page why and the peer connection is closed. The peer
connection, tasks, mic queue and media are released then. Nothing one session does can stop
another or the server.

Every request's ``Host`` must be an IP literal, ``localhost``, the bound host or one of
``allowed_hosts`` (403 otherwise): a DNS-rebinding page reaches a local server under its own name.
A connection without a complete request for ``idle_timeout_s`` is closed, a body must arrive within
``body_timeout_s``, a response the client does not take within ``write_timeout_s`` drops its
connection, and JSON is parsed within depth and number limits (``json_limits``). What a client
can make the server log (refusals, aiohttp's own errors) is rate-limited (``charstream.logs.log_limited``).
"""

from __future__ import annotations

import asyncio
import collections
import ipaddress
import json
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog
from aiohttp import web
from aiortc import RTCConfiguration, RTCIceServer, RTCPeerConnection, RTCRtpSender, RTCSessionDescription, sdp
from aiortc.mediastreams import MediaStreamTrack

from charstream.logs import LogLimit, log_limited
from charstream.pipeline.web.json_limits import loads
from charstream.stages.config import EgressConfig
from charstream.stages.egress.mic import CaptureClock, UserAudioQueue, pump_microphone, watch_sender_reports
from charstream.stages.egress.stage import PeerLink
from charstream.stages.egress.timing import BadReport, ClientTiming, _number, presented_frames
from charstream.stages.egress.tracks import PlayoutAudioTrack, PlayoutVideoTrack, TrackStart
from charstream.stages.playout.output import PlayoutOutput
from charstream.stages.shared.tracing import SEGMENTS, intervals
from charstream.transport.messages import TraceContext

log = structlog.get_logger("egress")
STATIC_DIR = Path(__file__).parent / "static"
CONTENT_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}
CODECS = {"VP8": "video/VP8", "H264": "video/H264"}
MAX_OFFER_BYTES = 256 * 1024  # every HTTP body
MAX_SDP_CHARS = 64 * 1024  # a browser's offer SDP is 3-12 KB
LINGER_S = 1.0
MAX_CODES = 16  # one-time codes waiting to be used; issuing more drops the oldest
OPUS = [c for c in RTCRtpSender.getCapabilities("audio").codecs if c.mimeType == "audio/opus"]


@dataclass
class SessionMedia:
    """What a session factory returns for one session (its graph already has an ``EgressStage`` on ``link``)."""

    output: PlayoutOutput  # the playout the tracks stream
    link: PeerLink  # the session's egress node, on the other end
    user_audio: UserAudioQueue = field(default_factory=UserAudioQueue)  # the mic, for ingest's VAD
    on_turn: Callable[[TraceContext], None] | None = None  # a turn got its client stamp (e.g. TurnTracer.merge)
    close: Callable[[], Awaitable[None]] | None = None  # stop the session's pipeline


SessionFactory = Callable[[str], Awaitable[SessionMedia]]


class OfferError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def video_codec_preferences(codec: str) -> list:
    if codec not in CODECS:
        raise ValueError(f"egress codec must be one of {sorted(CODECS)}, got {codec!r}")
    return [c for c in RTCRtpSender.getCapabilities("video").codecs
            if c.mimeType == CODECS[codec] or c.mimeType == "video/rtx"]


class Peer:
    """One browser (or test client): its reservation, peer connection, tracks, timing and tasks."""

    def __init__(self, server: EgressServer, session_id: str, token: str, client: str | None) -> None:
        self.server = server
        self.session_id = session_id
        self.token = token
        self.client = client  # the address that reserved it (None: reserved in-process)
        self.state = "reserved"  # reserved -> active -> closed
        self.end_reason: str | None = None  # why it closed (a fleet's front door reports it)
        self.pc: RTCPeerConnection | None = None
        self.media: SessionMedia | None = None
        self.video: PlayoutVideoTrack | None = None
        self.timing: ClientTiming | None = None
        self.channel = None
        self.tasks: list[asyncio.Task] = []
        self.bad_messages = 0
        self._log_limit = LogLimit()  # what the client sends on the data channel
        self.turn_segments: dict[int, dict[str, float]] = {}
        self.closed = asyncio.Event()
        self.session_ended = False  # the session ended before the peer (set by its egress node)
        self.expiry: asyncio.TimerHandle | None = None  # releases the reservation if no offer comes
        self.log = log.bind(session_id=session_id)

    async def answer(self, offer: RTCSessionDescription) -> RTCSessionDescription:
        config = self.server.config
        self.state = "active"
        # before the factory: a bad offer must not start a pipeline; parsed off the loop (up to 64 KB)
        await asyncio.to_thread(_check_offer, offer.sdp, config.max_offer_candidates)
        self.media = await self.server.factory(self.session_id)
        start = TrackStart(self.media.output)
        self.video = PlayoutVideoTrack(start)
        audio = PlayoutAudioTrack(start)
        self.timing = ClientTiming(self.media.output, self.video.frame_index, on_turn=self._on_turn)
        # Explicit ICE servers: aiortc would otherwise ask Google's public STUN server.
        self.pc = pc = RTCPeerConnection(RTCConfiguration([RTCIceServer(url) for url in config.ice_servers]))
        pc.on("connectionstatechange", self._on_connection_state)
        pc.on("track", self._on_track)
        pc.on("datachannel", self._on_datachannel)
        # Transceivers exist before the offer is applied, so the codec preference shapes the answer.
        video_transceiver = pc.addTransceiver(self.video, direction="sendonly")
        video_transceiver.setCodecPreferences(video_codec_preferences(config.codec))
        audio_transceiver = pc.addTransceiver(audio, direction="sendrecv")
        audio_transceiver.setCodecPreferences(OPUS)  # the audio track hands aiortc Opus packets
        self.video.sender = video_transceiver.sender
        try:
            await pc.setRemoteDescription(offer)
        except Exception as e:  # aiortc raises ValueError/OperationError/... for a bad SDP
            raise OfferError(400, f"offer SDP rejected: {type(e).__name__}: {e}") from e
        if video_transceiver.mid is None or audio_transceiver.mid is None:
            raise OfferError(400, "offer's audio/video sections do not match the session's tracks")
        await pc.setLocalDescription(await pc.createAnswer())
        self.media.link.attach(self._send, self._end_from_session)
        return pc.localDescription

    # --- events --------------------------------------------------------------------------------

    async def _on_connection_state(self) -> None:
        state = self.pc.connectionState if self.pc else "closed"
        self.log.info("peer_connection_state", state=state)
        if state in ("failed", "closed"):
            await self.server.close_session(self.session_id, f"peer connection {state}")

    def _on_track(self, track: MediaStreamTrack) -> None:
        if track.kind == "audio" and self.media is not None:
            clock = CaptureClock(self._client_to_server)
            for receiver in self.pc.getReceivers():
                if receiver.track is track:
                    watch_sender_reports(receiver, clock)
            self.tasks.append(asyncio.create_task(
                pump_microphone(track, self.media.user_audio, self.session_id, clock), name=f"mic-{self.session_id}"))

    def _client_to_server(self, client_time: float) -> float | None:
        clock = self.timing.clock if self.timing is not None else None
        return clock.to_server(client_time) if clock is not None and clock.known else None

    def _on_datachannel(self, channel) -> None:
        if self.channel is not None:
            self._log_limit(self.log.warning, "extra_datachannel_ignored", label=str(channel.label)[:100])
            return
        self.channel = channel
        channel.on("message", self._on_message)

    def _on_message(self, raw: Any) -> None:
        self.media.link.heard()
        try:
            if not isinstance(raw, str):
                raise BadReport("binary message")
            try:
                msg = loads(raw)
            except ValueError as e:
                raise BadReport(f"not JSON: {e}") from None
            if not isinstance(msg, dict):
                raise BadReport(f"expected a JSON object, got {type(msg).__name__}")
            kind = msg.get("type")
            if kind == "pong":
                self.timing.clock.add(_number(msg, "server_ms") / 1e3, _number(msg, "client_ms") / 1e3, time.time())
            elif kind == "frames":
                for rtp, presented_ms in presented_frames(msg):
                    self.timing.on_frame(rtp, presented_ms)
            elif kind == "hello":
                self.log.info("client_hello", agent=str(msg.get("agent", ""))[:200])
            else:
                raise BadReport(f"unknown message type {kind!r}")
        except BadReport as e:
            self.bad_messages += 1
            self._log_limit(self.log.warning, "datachannel_message_dropped", error=str(e)[:200], raw=str(raw)[:120])
        except Exception:  # our bug, not the client's: log it, keep the channel and the session
            self.bad_messages += 1
            self.log.exception("datachannel_message_failed", raw=str(raw)[:120])

    def _on_turn(self, trace: TraceContext) -> None:
        segments = {name: round(s * 1e3, 1) for name, s in intervals(trace.stamps, SEGMENTS).items()}
        self.turn_segments[trace.turn_id] = segments
        self.log.info("client_first_speaking_frame", turn_id=trace.turn_id, segments_ms=segments)
        # the turn's two ends on the page's own clock: its presented frame and the user's end of
        # speech as the server dated it (the page compares the latter with its own microphone)
        offset = self.timing.clock.offset
        on_page = {f"{point}_ms": round((trace.stamps[point] + offset) * 1e3, 1)
                   for point in ("user_speech_end", "client_first_speaking_frame") if point in trace.stamps}
        self._send({"type": "turn", "turn_id": trace.turn_id, "segments_ms": segments, **on_page})
        if self.media is not None and self.media.on_turn is not None:
            self.media.on_turn(trace)

    def _send(self, msg: dict[str, Any]) -> None:
        if self.channel is not None and self.channel.readyState == "open":
            self.channel.send(json.dumps(msg))

    async def _end_from_session(self, reason: str) -> None:
        """The session ended first (its egress node's teardown): tell the page why, then close. The
        close runs as its own task: it stops the session, which is what is ending right now."""
        self._send({"type": "end", "reason": reason})
        self.session_ended = True

        async def close_soon() -> None:
            await asyncio.sleep(0.2)  # let the message leave before the connection closes
            await self.server.close_session(self.session_id, f"session ended: {reason}")

        self.tasks.append(asyncio.create_task(close_soon(), name=f"close-{self.session_id}"))

    # --- teardown ------------------------------------------------------------------------------

    async def close(self, reason: str) -> None:
        if self.state == "closed":
            return
        self.state = "closed"
        if self.media is not None:
            self.media.link.closed(reason)  # the session's egress node ends the session
        self.end_reason = reason
        self.log.info("session_closed", reason=reason, bad_messages=self.bad_messages,
                      median_delivery_ms=self.timing.median_delivery_ms() if self.timing else None)
        current = asyncio.current_task()
        for task in self.tasks:
            if task is not current:
                task.cancel()
        if self.pc is not None:
            await self.pc.close()
        if self.media is not None:
            self.media.user_audio.close()
            if self.media.close is not None and not self.session_ended:
                try:
                    await self.media.close()
                except Exception:
                    self.log.exception("session_media_close_failed")
        self.closed.set()


class EgressServer:
    def __init__(self, config: EgressConfig, factory: SessionFactory, access_key: str | None = None) -> None:
        video_codec_preferences(config.codec)  # fail fast on a bad codec name
        self.config = config
        self.factory = factory
        self.access_key = access_key or secrets.token_urlsafe(16)
        self.sessions: dict[str, Peer] = {}
        self._by_token: dict[str, Peer] = {}
        self._codes: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._reserved_at: dict[str, collections.deque[float]] = {}  # per client: reservations in the last minute
        self._hosts = {"localhost", config.host.lower(), *(h.lower() for h in config.allowed_hosts)}
        # The page's few small files, held in memory: each response is a plain one, written within
        # write_timeout_s like any other (a file response is written by aiohttp after the middleware)
        self._files = {p.name: (p.read_bytes(), CONTENT_TYPES[p.suffix]) for p in STATIC_DIR.iterdir()
                       if p.suffix in CONTENT_TYPES}
        self.app = web.Application(client_max_size=MAX_OFFER_BYTES, middlewares=[self._bound_write, self._check_host])
        self.app.add_routes([
            web.get("/", self._index),
            web.get("/static/{name}", self._static),
            web.post("/code", self._redeem_code),
            web.post("/session", self._create_session),
            web.post("/offer", self._offer),
            web.post("/hangup", self._hangup),
        ])
        self._runner: web.AppRunner | None = None
        self.url = ""

    def create_session(self, client: str | None = None) -> tuple[str, str]:
        """Reserve a session; returns (session_id, token). The token admits one offer.

        ``client`` (the remote address of an HTTP request) is held to the per-client caps."""
        if len(self.sessions) >= self.config.max_sessions:
            raise OfferError(503, f"server full ({self.config.max_sessions} sessions)")
        if client is not None:
            self._admit(client)
        session_id = secrets.token_hex(6)
        token = secrets.token_urlsafe(24)
        session = Peer(self, session_id, token, client)
        self.sessions[session_id] = session
        self._by_token[token] = session
        # A reservation that never gets its offer must not hold a slot forever.
        session.expiry = asyncio.get_running_loop().call_later(self.config.offer_timeout_s, self._expire, session)
        return session_id, token

    def _admit(self, client: str) -> None:
        config = self.config
        mine = [s for s in self.sessions.values() if s.client == client]
        most = min(config.sessions_per_client, config.max_sessions)
        if len(mine) >= most:
            raise OfferError(429, f"{client} already holds {len(mine)} sessions (most {most} per client address)")
        waiting = sum(s.state == "reserved" for s in mine)
        if waiting >= config.reservations_per_client:
            raise OfferError(429, f"{client} already holds {waiting} reservations without an offer "
                                  f"(most {config.reservations_per_client})")
        now = time.monotonic()
        for address in list(self._reserved_at):  # forget clients quiet for a minute: the map stays small
            times = self._reserved_at[address]
            while times and now - times[0] > 60:
                times.popleft()
            if not times:
                del self._reserved_at[address]
        recent = self._reserved_at.setdefault(client, collections.deque())
        if len(recent) >= config.reservations_per_minute:
            raise OfferError(429, f"{client} made {len(recent)} reservations in the last minute "
                                  f"(most {config.reservations_per_minute}); try again later")
        recent.append(now)

    def issue_code(self) -> str:
        """A one-time code that ``POST /code`` trades for the server key (for a link to print)."""
        code = secrets.token_urlsafe(16)
        self._codes[code] = None
        while len(self._codes) > MAX_CODES:
            self._codes.popitem(last=False)
        return code

    def _expire(self, session: Peer) -> None:
        if session.state == "reserved" and self.sessions.get(session.session_id) is session:
            asyncio.create_task(self.close_session(session.session_id, "no offer in time"))

    async def close_session(self, session_id: str, reason: str) -> None:
        session = self.sessions.pop(session_id, None)
        if session is None:
            return
        self._by_token.pop(session.token, None)
        if session.expiry is not None:  # the timer would hold the closed session until it fires
            session.expiry.cancel()
        await session.close(reason)

    async def start(self) -> str:
        # keepalive_timeout also closes a connection whose first request never completes (slow headers);
        # after an error reply, the unread rest of a body is drained for at most LINGER_S, not 10 s.
        self._runner = web.AppRunner(self.app, access_log=None, keepalive_timeout=self.config.idle_timeout_s,
                                     lingering_time=LINGER_S)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.config.host, self.config.port)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # the real port when config.port is 0
        self.url = f"http://{self.config.host}:{port}"
        log.info("egress_listening", url=self.url, codec=self.config.codec)
        return self.url

    async def stop(self) -> None:
        for session_id in list(self.sessions):
            await self.close_session(session_id, "server stopping")
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    # --- handlers ------------------------------------------------------------------------------

    @web.middleware
    async def _bound_write(self, request: web.Request, handler) -> web.StreamResponse:
        """The response is written here, within ``write_timeout_s``: a client that does not read it
        (its socket's buffers full) would otherwise hold the connection and its handler forever."""
        try:
            response = await handler(request)
        except web.HTTPException as e:  # the router's 404/405: written here too
            response = web.Response(status=e.status, reason=e.reason, text=e.text, headers=e.headers)
        try:
            async with asyncio.timeout(self.config.write_timeout_s):
                await response.prepare(request)
                await response.write_eof()
        except TimeoutError:
            log_limited(log.warning, "response_not_read", timeout_s=self.config.write_timeout_s, peer=request.remote)
            if request.transport is not None:
                request.transport.abort()  # what aiohttp writes next raises ConnectionError, which it expects
        return response

    @web.middleware
    async def _check_host(self, request: web.Request, handler) -> web.StreamResponse:
        host = _hostname(request.headers.get("Host", ""))
        if host not in self._hosts and not _is_ip(host):
            log_limited(log.warning, "host_refused", host=request.headers.get("Host", "")[:200], peer=request.remote)
            return _error(403, f"Host {host[:100]!r} is not served here (add it to egress.allowed_hosts)")
        return await handler(request)

    async def _index(self, request: web.Request) -> web.StreamResponse:
        body, kind = self._files["index.html"]
        return web.Response(body=body, content_type=kind, charset="utf-8")

    async def _static(self, request: web.Request) -> web.StreamResponse:
        found = self._files.get(request.match_info["name"])
        if found is None:
            return _error(404, "no such file")
        return web.Response(body=found[0], content_type=found[1], charset="utf-8")

    async def _redeem_code(self, request: web.Request) -> web.Response:
        try:
            code = (await self._json_body(request)).get("code")
        except OfferError as e:
            return _error(e.status, str(e))
        if not isinstance(code, str) or code not in self._codes:
            return _error(403, "unknown or already used code")
        del self._codes[code]
        return web.json_response({"key": self.access_key})

    async def _create_session(self, request: web.Request) -> web.Response:
        # Bytes, not str: compare_digest refuses non-ASCII str (a header of any bytes is just wrong).
        given = request.headers.get("X-Charstream-Key", "").encode("utf-8", "surrogateescape")
        if not secrets.compare_digest(given, self.access_key.encode()):
            return _error(403, "wrong or missing X-Charstream-Key")
        try:
            session_id, token = self.create_session(request.remote or "?")
        except OfferError as e:
            log_limited(log.warning, "reservation_refused", status=e.status, error=str(e))
            return _error(e.status, str(e))
        return web.json_response({"session_id": session_id, "token": token})

    async def _offer(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_body(request)
            token, sdp, kind = body.get("token"), body.get("sdp"), body.get("type")
            if not isinstance(token, str) or not isinstance(sdp, str) or kind != "offer":
                raise OfferError(400, 'body must be {"token": str, "sdp": str, "type": "offer"}')
            session = self._by_token.get(token)
            if session is None:
                raise OfferError(403, "unknown session token")
            if session.state != "reserved":
                raise OfferError(409, "this session already has a connection (replayed offer?)")
        except OfferError as e:
            log_limited(log.warning, "offer_rejected", status=e.status, error=str(e), peer=request.remote)
            return _error(e.status, str(e))
        try:
            answer = await session.answer(RTCSessionDescription(sdp=sdp, type="offer"))
        except OfferError as e:
            await self.close_session(session.session_id, f"offer rejected: {e}")
            log_limited(log.warning, "offer_rejected", status=e.status, error=str(e), session_id=session.session_id)
            return _error(e.status, str(e))
        except Exception as e:
            await self.close_session(session.session_id, f"session setup failed: {e}")
            log.exception("session_setup_failed", session_id=session.session_id)
            return _error(500, f"session setup failed: {type(e).__name__}: {e}")
        return web.json_response({"sdp": answer.sdp, "type": answer.type, "session_id": session.session_id})

    async def _token_request(self, request: web.Request) -> tuple[dict[str, Any], Any]:
        """The request's JSON body and the session its ``token`` names (OfferError: 4xx)."""
        body = await self._json_body(request)
        token = body.get("token")
        session = self._by_token.get(token) if isinstance(token, str) else None
        if session is None:
            raise OfferError(403, "unknown session token")
        return body, session

    async def _hangup(self, request: web.Request) -> web.Response:
        try:
            _, session = await self._token_request(request)
        except OfferError as e:
            return _error(e.status, str(e))
        await self.close_session(session.session_id, "client hung up")
        return web.json_response({"closed": session.session_id})

    async def _json_body(self, request: web.Request) -> dict[str, Any]:
        try:
            async with asyncio.timeout(self.config.body_timeout_s):
                body = loads(await request.read())
        except TimeoutError:
            raise OfferError(408, f"body not received within {self.config.body_timeout_s:g} s") from None
        except ValueError as e:
            raise OfferError(400, f"body is not JSON: {e}") from None
        except web.HTTPRequestEntityTooLarge:
            raise OfferError(413, f"body larger than {MAX_OFFER_BYTES} bytes") from None
        if not isinstance(body, dict):
            raise OfferError(400, "body must be a JSON object")
        return body


def _check_offer(text: str, max_candidates: int) -> None:
    if len(text) > MAX_SDP_CHARS:
        raise OfferError(400, f"offer SDP of {len(text)} characters (most {MAX_SDP_CHARS})")
    # Counted before parsing: aiortc sends connectivity checks to every candidate an offer lists.
    # Distinct ones: a browser repeats its candidates in each media section.
    candidates = {line.strip() for line in text.splitlines() if line.startswith("a=candidate:")}
    if len(candidates) > max_candidates:
        raise OfferError(400, f"offer lists {len(candidates)} ICE candidates (most {max_candidates})")
    try:
        kinds = sorted(m.kind for m in sdp.SessionDescription.parse(text).media)
    except Exception as e:  # aiortc's parser raises whatever the malformed line triggers
        raise OfferError(400, f"offer SDP rejected: {type(e).__name__}: {e}") from e
    if kinds != ["application", "audio", "video"]:
        raise OfferError(400, f"offer must have one audio, one video and one data-channel section, got {kinds}")


def _hostname(host: str) -> str:
    """The name in a Host header, without the port (``[::1]:8080`` -> ``::1``), lowercased."""
    host = host.strip().lower()
    if host.startswith("["):
        return host[1:host.find("]")] if "]" in host else host
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def _is_ip(host: str) -> bool:
    # An attacker's page cannot make a browser send an IP literal it did not navigate to: only names rebind.
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)
