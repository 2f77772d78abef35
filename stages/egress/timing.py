"""Client timing over the data channel: clock offset by ping/pong, and presented-frame reports.

Protocol (JSON text messages on the ``timing`` data channel; times are wall-clock milliseconds):

* server → client ``{"type": "ping", "id": n, "server_ms": t}``; the client answers at once with
  ``{"type": "pong", "id": n, "server_ms": t, "client_ms": its clock}``. The offset
  (client − server) is taken from the pong with the smallest round trip among the recent ones,
  assuming symmetric paths: ``client_ms − (sent + received) / 2``.
* client → server ``{"type": "frames", "frames": [[RTP timestamp, presented_ms], ...]}``: the video
  frames it presented (``requestVideoFrameCallback``: ``metadata.rtpTimestamp`` and
  ``performance.timeOrigin + metadata.presentationTime``), ``FRAMES_PER_REPORT`` a message (at most
  ``MAX_FRAMES_PER_REPORT``): one message a frame took about a tenth of a server event loop's
  samples in SCTP, DTLS, JSON and the report's handling. The server maps the
  RTP timestamp to the output frame and its playout release time, so delivery = presented (server clock) −
  released. Reports of a chunk's first frame are kept; the first speaking frame of a turn gets
  ``client_first_speaking_frame``.
* server → client ``{"type": "turn", "turn_id": n, "segments_ms": {...}}`` once a turn's client
  stamp is in (the page's latency overlay); ``{"type": "end", "reason": ...}`` when the session's
  pipeline has ended.
* A client that sends nothing for ``client_timeout_s`` (pongs included) is taken as vanished.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from charstream.stages.playout.output import FrameRecord, PlayoutOutput
from charstream.timeline import VIDEO_FPS
from charstream.transport.messages import TraceContext

FRAMES_PER_REPORT = 6  # a quarter of a second of presented frames a message; the page's app.js sends as many
MAX_FRAMES_PER_REPORT = 48


class BadReport(ValueError):
    """A data-channel message that is not the expected JSON."""


def _finite(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int | float) and math.isfinite(value)


def _number(msg: dict[str, Any], key: str) -> float:
    value = msg.get(key)
    if not _finite(value):
        raise BadReport(f"{msg.get('type')!r} message needs a finite number {key!r}, got {value!r}")
    return float(value)


def presented_frames(msg: dict[str, Any]) -> list[tuple[int, float]]:
    """A ``frames`` message's (RTP timestamp, presented_ms) pairs, all checked before any is used."""
    frames = msg.get("frames")
    if not isinstance(frames, list) or not 0 < len(frames) <= MAX_FRAMES_PER_REPORT:
        raise BadReport(f"'frames' message needs a list of 1-{MAX_FRAMES_PER_REPORT} [rtp, presented_ms] pairs")
    for entry in frames:
        if not isinstance(entry, list) or len(entry) != 2 or not all(map(_finite, entry)):
            raise BadReport(f"'frames' entry must be [rtp, presented_ms], two finite numbers, got {str(entry)[:60]}")
    return [(int(rtp), float(presented)) for rtp, presented in frames]


class ClockOffset:
    """Client-minus-server clock offset from ping/pong, min-RTT filtered over recent samples."""

    def __init__(self, window: int = 16) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=window)  # (rtt, offset), seconds

    def add(self, sent: float, client: float, received: float) -> None:
        if received < sent:
            raise BadReport("pong received before its ping was sent")
        self._samples.append((received - sent, client - (sent + received) / 2))

    @property
    def known(self) -> bool:
        return bool(self._samples)

    @property
    def offset(self) -> float:
        return min(self._samples)[1]

    @property
    def rtt(self) -> float:
        return min(self._samples)[0]

    def to_server(self, client_time: float) -> float:
        return client_time - self.offset


@dataclass
class Delivery:
    """One presented frame: when playout released it, when the client showed it (server clock)."""

    index: int
    chunk: int | None
    released_at: float
    presented_at: float

    @property
    def seconds(self) -> float:
        return self.presented_at - self.released_at


@dataclass
class ClientTiming:
    """Turns a client's reports into deliveries and ``client_first_speaking_frame`` stamps."""

    output: PlayoutOutput
    frame_index: Callable[[int], int | None]  # RTP timestamp -> output frame (the video track's)
    on_turn: Callable[[TraceContext], None] | None = None  # a turn's trace got its client stamp
    clock: ClockOffset = field(default_factory=ClockOffset)
    chunk_deliveries: deque[Delivery] = field(default_factory=lambda: deque(maxlen=2048))
    frames_reported: int = 0
    unmatched_reports: int = 0  # frame no longer in history, or RTP origin unknown yet
    _scanned_to: int = 0  # output frames below this were checked for a turn's first speaking frame

    def on_frame(self, rtp: int, presented_ms: float) -> None:
        """One presented frame: its RTP timestamp and when the client presented it (its clock, ms)."""
        presented_client = presented_ms / 1e3
        self.frames_reported += 1
        index = self.frame_index(rtp)
        frame = self.output.record(index) if index is not None else None
        if frame is None or not self.clock.known:
            self.unmatched_reports += 1
            return
        delivery = Delivery(frame.index, frame.chunk, frame.released_at, self.clock.to_server(presented_client))
        if frame.chunk is not None and frame.frame_in_chunk == 0:
            self.chunk_deliveries.append(delivery)
        self._stamp_turn(frame, delivery)

    def _stamp_turn(self, frame: FrameRecord, delivery: Delivery) -> None:
        # The client may skip the exact frame (requestVideoFrameCallback coalesces), so the first
        # presented frame at or after a turn's first speaking frame stands for it.
        first_speaking = None
        for index in range(max(self._scanned_to, frame.index - VIDEO_FPS * 5), frame.index + 1):
            released = self.output.record(index)
            if released is not None and released.first_speaking and released.trace is not None:
                first_speaking = released
        self._scanned_to = max(self._scanned_to, frame.index + 1)
        if first_speaking is not None:
            first_speaking.trace.stamp("client_first_speaking_frame", delivery.presented_at)
            if self.on_turn is not None:
                self.on_turn(first_speaking.trace)

    def median_delivery_ms(self) -> float | None:
        values = [d.seconds * 1e3 for d in self.chunk_deliveries]
        return statistics.median(values) if values else None
