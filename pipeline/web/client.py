"""An in-process aiortc client of the egress server: what tests, benchmarks and the demo connect.

It does what the web page does: offers to receive video and audio (and send a microphone track
if given one), opens the ``timing`` data channel, answers pings and reports every video frame it
receives, ``FRAMES_PER_REPORT`` a message (``presented_ms`` = when the decoded frame came out of
aiortc). It keeps what it got, in bounded windows (a client of an hour-long session must not grow):
of the last ``kept_s`` seconds (60 by default), per video frame its arrival time and RTP timestamp
(optionally the image; ``video_frames`` counts them all) and per audio frame the samples
(``audio_samples`` counts them all); and the sender reports (RTCP SR, the last ``MAX_REPORTS``) of both streams, from which
``sender_time`` maps an RTP timestamp to the server's wall clock exactly as a browser's lip sync
does. With ``record_path`` it writes what it received to an mp4 (H.264 + AAC, timed by RTP
timestamps, so freezes and gaps stay where they happened).

Usage::

    client = EgressClient(record_path="session.mp4")
    await client.connect(server_url, token)
    ...
    await client.close()
"""

from __future__ import annotations

import asyncio
import fractions
import json
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import av
import numpy as np
import structlog
from aiortc import RTCConfiguration, RTCIceServer, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from aiortc.rtp import RtcpSrPacket

from charstream.stages.egress.timing import FRAMES_PER_REPORT
from charstream.timeline import TIMELINE_RATE, VIDEO_FPS

log = structlog.get_logger("egress.client")
KEPT_S = 60.0  # seconds of received media kept: ~165 bytes a video frame without images, ~2 KB an audio frame
AUDIO_FRAMES_PER_S = 50  # aiortc's 20 ms audio frames
MAX_REPORTS = 600  # RTCP sender reports kept per stream


class SignalingError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


@dataclass
class ReceivedVideo:
    arrival: float  # wall clock when aiortc handed over the decoded frame
    rtp: int  # the RTP timestamp it was sent with (90 kHz)
    image: np.ndarray | None  # RGB, when ``keep_images``


@dataclass
class ReceivedAudio:
    arrival: float
    rtp: int  # RTP timestamp of the first sample (48 kHz)
    samples: np.ndarray  # int16 mono


class EgressClient:
    def __init__(self, mic: MediaStreamTrack | None = None, record_path: str | Path | None = None,
                 keep_images: bool = False, ice_servers: list[str] | None = None, kept_s: float = KEPT_S) -> None:
        self.mic = mic
        self.ice_servers = ice_servers or []  # none by default: aiortc's default is Google's public STUN
        self.keep_images = keep_images
        self.recorder = Recorder(Path(record_path)) if record_path else None
        self.pc: RTCPeerConnection | None = None
        self.channel = None
        self.session_id: str | None = None
        self.video: deque[ReceivedVideo] = deque(maxlen=max(1, round(kept_s * VIDEO_FPS)))
        self.video_frames = 0  # every video frame received, also those no longer kept
        self.audio: deque[ReceivedAudio] = deque(maxlen=max(1, round(kept_s * AUDIO_FRAMES_PER_S)))
        self.audio_samples = 0  # every sample received, also those no longer kept
        # (ntp s, rtp) per stream
        self.sender_reports: dict[str, deque[tuple[float, int]]] = {k: deque(maxlen=MAX_REPORTS) for k in ("video", "audio")}
        self.turns: list[dict[str, Any]] = []  # the server's per-turn latency messages
        self.ended: str | None = None  # the server's reason, when it ended the session
        self.pings_answered = 0
        self.silent = False  # True: send nothing on the data channel (a client that vanished without closing)
        self._tasks: list[asyncio.Task] = []
        self._presented: list[list[float]] = []  # [rtp, presented_ms] not reported yet
        self._origins: dict[str, Any] = {}

    async def connect(self, base_url: str, token: str, timeout: float = 30.0) -> None:
        self.pc = pc = RTCPeerConnection(RTCConfiguration([RTCIceServer(url) for url in self.ice_servers]))
        pc.addTransceiver("video", direction="recvonly")
        if self.mic is not None:
            pc.addTransceiver(self.mic, direction="sendrecv")
        else:
            pc.addTransceiver("audio", direction="recvonly")
        self.channel = pc.createDataChannel("timing")
        self.channel.on("message", self._on_message)
        self.channel.on("open", lambda: self.channel.send(json.dumps({"type": "hello", "agent": "aiortc"})))
        pc.on("track", self._on_track)
        await pc.setLocalDescription(await pc.createOffer())
        body = {"token": token, "sdp": pc.localDescription.sdp, "type": pc.localDescription.type}
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{base_url}/offer", json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
                data = await r.json()
                if r.status != 200:
                    raise SignalingError(r.status, data.get("error", ""))
        self.session_id = data["session_id"]
        await pc.setRemoteDescription(RTCSessionDescription(sdp=data["sdp"], type=data["type"]))
        # Record each stream's sender reports: they map its RTP clock to the server's wall clock.
        for transceiver in pc.getTransceivers():
            self._watch_sender_reports(transceiver.receiver, transceiver.kind)

    async def wait_for_video(self, frames: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.video_frames < frames:
            if time.monotonic() > deadline:
                raise TimeoutError(f"got {self.video_frames} of {frames} video frames in {timeout} s")
            await asyncio.sleep(0.05)

    def sender_time(self, kind: str, rtp: int) -> float | None:
        """The server wall-clock time an RTP timestamp stands for, by the sender reports.

        Each report pairs a send time with an RTP timestamp; a report taken just after a packet
        that left late maps every timestamp late by as much, so the earliest mapping among the
        reports is used (the min-RTT idea; clock drift over a loopback session is negligible).
        """
        reports = self.sender_reports[kind]
        if not reports:
            return None
        rate = 90_000 if kind == "video" else TIMELINE_RATE
        return min(ntp + ((rtp - sr_rtp + 2**31) % 2**32 - 2**31) / rate for ntp, sr_rtp in reports)

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self.pc is not None:
            await self.pc.close()
        if self.recorder is not None:
            self.recorder.close()

    # --- internals -----------------------------------------------------------------------------

    def _on_track(self, track: MediaStreamTrack) -> None:
        reader = self._read_video if track.kind == "video" else self._read_audio
        self._tasks.append(asyncio.create_task(reader(track)))

    def _rtp_origin(self, kind: str) -> int:
        # aiortc's receiver rebases RTP timestamps to 0 at the first frame; its private mapper
        # keeps the origin, which the server needs to match reports to frames.
        receiver = next(t.receiver for t in self.pc.getTransceivers() if t.kind == kind)
        origin = receiver._RTCRtpReceiver__timestamp_mapper._origin
        return 0 if origin is None else origin

    async def _read_video(self, track: MediaStreamTrack) -> None:
        try:
            while True:
                frame = await track.recv()
                arrival = time.time()
                rtp = (self._rtp_origin("video") + frame.pts) % 2**32
                image = frame.to_ndarray(format="rgb24") if self.keep_images or self.recorder else None
                self.video.append(ReceivedVideo(arrival, rtp, image if self.keep_images else None))
                self.video_frames += 1
                self._presented.append([rtp, arrival * 1e3])
                if len(self._presented) == FRAMES_PER_REPORT:
                    self._send({"type": "frames", "frames": self._presented})
                    self._presented = []
                if self.recorder is not None:
                    self.recorder.video(image, frame.pts)
        except MediaStreamError:
            pass

    async def _read_audio(self, track: MediaStreamTrack) -> None:
        try:
            while True:
                frame = await track.recv()
                arrival = time.time()
                samples = frame.to_ndarray().reshape(-1, len(frame.layout.channels))[:, 0].astype(np.int16)
                if frame.sample_rate != TIMELINE_RATE:
                    raise RuntimeError(f"expected {TIMELINE_RATE} Hz audio, got {frame.sample_rate}")
                rtp = (self._rtp_origin("audio") + frame.pts) % 2**32
                self.audio.append(ReceivedAudio(arrival, rtp, samples))
                self.audio_samples += len(samples)
                if self.recorder is not None:
                    self.recorder.audio(samples)
        except MediaStreamError:
            pass

    def _watch_sender_reports(self, receiver, kind: str) -> None:
        handle = receiver._handle_rtcp_packet
        reports = self.sender_reports[kind]

        async def handle_and_record(packet) -> None:
            if isinstance(packet, RtcpSrPacket):
                ntp = packet.sender_info.ntp_timestamp
                unix = (ntp >> 32) - 2_208_988_800 + (ntp & 0xFFFFFFFF) / 2**32
                reports.append((unix, packet.sender_info.rtp_timestamp))
            await handle(packet)

        receiver._handle_rtcp_packet = handle_and_record

    def _on_message(self, raw: Any) -> None:
        msg = json.loads(raw)
        if msg.get("type") == "ping":
            self._send({"type": "pong", "id": msg["id"], "server_ms": msg["server_ms"], "client_ms": time.time() * 1e3})
            self.pings_answered += 1
        elif msg.get("type") == "turn":
            self.turns.append(msg)
        elif msg.get("type") == "end":
            self.ended = msg.get("reason", "")

    def _send(self, msg: dict[str, Any]) -> None:
        if self.channel is not None and self.channel.readyState == "open" and not self.silent:
            self.channel.send(json.dumps(msg))


class AudioSamplesTrack(MediaStreamTrack):
    """A microphone stand-in: plays 48 kHz int16 mono samples in real time (20 ms frames), then silence."""

    kind = "audio"

    def __init__(self, samples: np.ndarray, loop: bool = False) -> None:
        super().__init__()
        self.samples = samples.astype(np.int16)
        self.loop = loop
        self._position = 0
        self._start: float | None = None

    async def recv(self) -> av.AudioFrame:
        if self._start is None:
            self._start = time.monotonic()
        delay = self._start + self._position / TIMELINE_RATE - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        n = TIMELINE_RATE // 50
        chunk = np.zeros(n, np.int16)
        offset = self._position % len(self.samples) if self.loop else self._position
        piece = self.samples[offset:offset + n]
        chunk[:len(piece)] = piece
        frame = av.AudioFrame.from_ndarray(chunk.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = TIMELINE_RATE
        frame.pts = self._position
        frame.time_base = fractions.Fraction(1, TIMELINE_RATE)
        self._position += n
        return frame


class Recorder:
    """Writes received frames to an mp4 at their RTP times (H.264 yuv420p + AAC 48 kHz mono).

    Audio that arrives before the first video frame is held (bounded) until the video stream
    exists: audio muxed first would write the mp4 header without the video stream, and
    libavformat then dies with SIGFPE on the first video packet.
    """

    HELD_AUDIO_PACKETS = 10 * 50  # 10 s of 20 ms packets; older ones are dropped

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self.container = av.open(str(path), mode="w")
        self._video = None
        self._audio = self.container.add_stream("aac", rate=TIMELINE_RATE, layout="mono")
        self._fifo = av.AudioFifo()
        self._video_origin: int | None = None
        self._held: deque[np.ndarray] = deque(maxlen=self.HELD_AUDIO_PACKETS)

    def video(self, image: np.ndarray, pts: int) -> None:
        if self._video is None:
            height, width = image.shape[:2]
            self._video = self.container.add_stream("libx264", rate=VIDEO_FPS)
            self._video.width, self._video.height = width - width % 2, height - height % 2
            self._video.pix_fmt = "yuv420p"
            self._video.time_base = fractions.Fraction(1, 90_000)
            self._video.options = {"crf": "18", "preset": "veryfast"}
            self._video_origin = pts
        frame = av.VideoFrame.from_ndarray(image[: self._video.height, : self._video.width], format="rgb24")
        frame.pts = pts - self._video_origin
        frame.time_base = fractions.Fraction(1, 90_000)
        self._mux(self._video.encode(frame))

    def audio(self, samples: np.ndarray) -> None:
        if self._video is None:
            self._held.append(samples)
            return
        while self._held:
            self._encode_audio(self._held.popleft())
        self._encode_audio(samples)

    def _encode_audio(self, samples: np.ndarray) -> None:
        # The fifo re-frames for AAC (1,024 samples) and counts time from the first sample: aiortc's
        # audio is continuous (playout sends silence rather than nothing), so counting is exact.
        frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = TIMELINE_RATE
        self._fifo.write(frame)
        while self._fifo.samples >= 1024:
            self._mux(self._audio.encode(self._fifo.read(1024)))

    def close(self) -> None:
        if self._video is not None:
            self._mux(self._video.encode(None))
        self._mux(self._audio.encode(None))
        self.container.close()

    def _mux(self, packets) -> None:
        for packet in packets:
            self.container.mux(packet)
