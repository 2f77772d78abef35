"""The user's microphone, handed from WebRTC to ingest (VAD).

Interface for ingest: a ``UserAudioQueue`` per session. Egress ``put``s every received mic frame
as a ``UserAudioFrame`` (48 kHz mono int16, 20 ms = 960 samples from a browser, stamped with the
wall-clock time it arrived and, once known, when its first sample was captured); ingest awaits
``get()``.

Capture time (``CaptureClock``): the browser's audio carries RTP timestamps (48 kHz for Opus) and
its RTCP sender reports pair one of them with the browser's wall clock (NTP); the data channel's
ping/pong gives that clock's offset from ours (``stages.egress.timing.ClockOffset``). So each
frame's first sample is dated where the user spoke it, before the network, the jitter buffer and
the decoder delayed it. The queue is bounded: when ingest falls
behind, the oldest frame is dropped and counted (``dropped``), so a stalled VAD can never grow
memory, and egress never waits (aiortc's own receive queue is unbounded, so the mic track must
be drained at the rate it arrives). ``close()`` ends the stream: ``get()`` then raises
``UserAudioClosed`` once the queue is empty.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import structlog
from aiortc import RTCRtpReceiver
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from aiortc.rtp import RtcpSrPacket
from av import AudioResampler

from charstream.timeline import TIMELINE_RATE

log = structlog.get_logger("egress.mic")


class UserAudioClosed(Exception):
    """The user's microphone stream ended."""


NTP_UNIX_OFFSET_S = 2_208_988_800  # 1900-01-01 to 1970-01-01
RTP_WRAP = 1 << 32


@dataclass
class UserAudioFrame:
    samples: np.ndarray  # int16 mono at 48 kHz
    received_at: float  # wall clock (time.time())
    captured_at: float | None = None  # server wall clock of samples[0] at the browser's microphone, once known


class CaptureClock:
    """The browser's microphone timeline on the server's clock: RTP timestamp → RTCP sender report
    (the sender's NTP wall clock) → the client-to-server clock offset."""

    def __init__(self, to_server: Callable[[float], float | None], rate: int = TIMELINE_RATE) -> None:
        self.to_server = to_server  # client wall seconds -> server wall seconds; None while unknown
        self.rate = rate
        self._report: tuple[int, float] | None = None  # (RTP timestamp, sender wall seconds)
        self.first_rtp: int | None = None  # the stream's first RTP timestamp: aiortc's decoded pts count from it
        self.reports = 0

    def on_rtp(self, rtp_timestamp: int) -> None:
        if self.first_rtp is None:
            self.first_rtp = rtp_timestamp

    def on_sender_report(self, rtp_timestamp: int, ntp_timestamp: int) -> None:
        """An RTCP sender report of the mic's stream: ``ntp_timestamp`` is 64-bit NTP (32.32)."""
        self._report = (rtp_timestamp, ntp_timestamp / RTP_WRAP - NTP_UNIX_OFFSET_S)
        self.reports += 1

    def captured_at(self, pts: int) -> float | None:
        """When the sample at ``pts`` (aiortc's decoded-frame pts: RTP ticks since the stream's first
        packet) was captured, on the server's clock (None until a sender report and the clock
        offset are both known)."""
        if self._report is None or self.first_rtp is None:
            return None
        report_rtp, report_wall = self._report
        rtp_timestamp = (self.first_rtp + pts) % RTP_WRAP
        delta = (rtp_timestamp - report_rtp + RTP_WRAP // 2) % RTP_WRAP - RTP_WRAP // 2  # across the wrap
        return self.to_server(report_wall + delta / self.rate)


class UserAudioQueue:
    """Bounded drop-oldest queue of mic frames between egress and ingest."""

    def __init__(self, max_frames: int = 100) -> None:
        self._frames: deque[UserAudioFrame] = deque(maxlen=max_frames)
        self._ready = asyncio.Event()
        self.closed = False
        self.received = 0
        self.dropped = 0

    def __len__(self) -> int:
        return len(self._frames)

    def put(self, frame: UserAudioFrame) -> None:
        if self.closed:
            return
        if len(self._frames) == self._frames.maxlen:
            self.dropped += 1
        self._frames.append(frame)
        self.received += 1
        self._ready.set()

    async def get(self) -> UserAudioFrame:
        while not self._frames:
            if self.closed:
                raise UserAudioClosed
            self._ready.clear()
            await self._ready.wait()
        return self._frames.popleft()

    def close(self) -> None:
        self.closed = True
        self._ready.set()


def watch_sender_reports(receiver: RTCRtpReceiver, clock: CaptureClock) -> None:
    """Feed ``clock`` the mic stream's first RTP timestamp and its RTCP sender reports. aiortc keeps
    neither where it can be read (decoded frames count from the first packet; a report's RTP
    timestamp is dropped), so the receiver's packet handlers are wrapped to read them on the way in."""
    handle_rtcp, handle_rtp = receiver._handle_rtcp_packet, receiver._handle_rtp_packet

    async def on_rtcp(packet) -> None:
        if isinstance(packet, RtcpSrPacket):
            clock.on_sender_report(packet.sender_info.rtp_timestamp, packet.sender_info.ntp_timestamp)
        await handle_rtcp(packet)

    async def on_rtp(packet, arrival_time_ms: int) -> None:
        clock.on_rtp(packet.timestamp)
        await handle_rtp(packet, arrival_time_ms)

    receiver._handle_rtcp_packet = on_rtcp
    receiver._handle_rtp_packet = on_rtp


async def pump_microphone(track: MediaStreamTrack, sink: UserAudioQueue, session_id: str,
                          clock: CaptureClock | None = None) -> None:
    """Read the remote mic track until it ends, resampled to 48 kHz mono int16, into ``sink``; with
    ``clock``, each frame is dated at capture from its RTP timestamp (aiortc's decoded ``pts``)."""
    resampler = AudioResampler(format="s16", layout="mono", rate=TIMELINE_RATE)
    try:
        while True:
            frame = await track.recv()
            now = time.time()
            captured = clock.captured_at(frame.pts) if clock is not None and frame.pts is not None else None
            for out in resampler.resample(frame):  # 48 kHz in, 48 kHz out: one frame, same first sample
                sink.put(UserAudioFrame(out.to_ndarray().reshape(-1).astype(np.int16, copy=False), now, captured))
    except MediaStreamError:
        log.info("mic_ended", session_id=session_id, received=sink.received, dropped=sink.dropped)
    finally:
        sink.close()
