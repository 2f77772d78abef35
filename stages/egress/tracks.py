"""WebRTC tracks that read a session's ``PlayoutOutput``: video at 90 kHz pts, audio at 48 kHz.

A/V sync. aiortc's RTCP sender report maps "now" (when a packet is sent) to that packet's RTP
timestamp, per track. So the receiver lines audio and video up correctly only if both tracks
send each frame at the wall time its pts stands for, from one origin. aiortc's own example
tracks each start their own ``time.time()`` clock at their first ``recv`` and its Opus encoder
counts samples from its first packet, so two tracks that start at different moments, or one
that sends a backlog in a burst, carry a fixed offset for the whole call. Here both tracks take
their pts from the playout output index (frame ``i`` ⇒ video pts ``i·3750``, audio sample
``i·2000``), both start at the same output frame (``TrackStart``), and each frame or 20 ms
audio packet is returned on its deadline on the playout clock (audio packets a constant 18 ms
after their first sample: ``AUDIO_SEND_LAG_SAMPLES``).
"""

from __future__ import annotations

import asyncio
import fractions
import math
import time

import av
import numpy as np
from aiortc import RTCRtpSender
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from av import AudioFrame, VideoFrame
from av.video.reformatter import VideoReformatter

from charstream.stages.playout.output import PlayoutClosed, PlayoutOutput
from charstream.timeline import SAMPLES_PER_FRAME, TIMELINE_RATE, VIDEO_FPS

VIDEO_CLOCK_RATE = 90_000
VIDEO_PTS_PER_FRAME = VIDEO_CLOCK_RATE // VIDEO_FPS  # 3,750
AUDIO_PACKET_SAMPLES = 960  # 20 ms: one Opus frame per packet
OPUS_BITRATE = 64_000  # mono speech
VIDEO_TIME_BASE = fractions.Fraction(1, VIDEO_CLOCK_RATE)
AUDIO_TIME_BASE = fractions.Fraction(1, TIMELINE_RATE)
# A 20 ms packet often ends inside a 41.7 ms frame not yet released: its last sample is available
# up to 880 samples (18.3 ms) after the packet's start. Sending every packet that much after its
# start keeps the packets on an exact 20 ms grid (a sawtooth of 0-18 ms send jitter would make the
# browser's audio jitter buffer, and with lip sync the video, wait longer); the cost is a constant
# 18 ms of audio lag in the sender reports, well inside one frame.
AUDIO_SEND_LAG_SAMPLES = max(
    SAMPLES_PER_FRAME * ((AUDIO_PACKET_SAMPLES * k + AUDIO_PACKET_SAMPLES - 1) // SAMPLES_PER_FRAME)
    - AUDIO_PACKET_SAMPLES * k
    for k in range(math.lcm(SAMPLES_PER_FRAME, AUDIO_PACKET_SAMPLES) // AUDIO_PACKET_SAMPLES))  # one period


class TrackStart:
    """The output frame at which a session's audio and video tracks both begin."""

    def __init__(self, output: PlayoutOutput) -> None:
        self.output = output
        self.index: int | None = None

    async def first_index(self) -> int:
        if self.index is None:
            await self.output.wait_started()
            if self.index is None:  # the other track may have fixed it while we waited
                self.index = self.output.next_index
        return self.index


class PlayoutVideoTrack(MediaStreamTrack):
    kind = "video"

    def __init__(self, start: TrackStart) -> None:
        super().__init__()
        self.start = start
        self.output = start.output
        self.sender: RTCRtpSender | None = None  # set by the server; used to learn the RTP origin
        self.rtp_origin: int | None = None  # RTP timestamp = origin + pts (mod 2**32)
        self.skipped_frames = 0  # frames this track fell behind on (slow encoder)
        self._next: int | None = None
        self._last_index: int | None = None
        self._packets_seen = 0
        # The encoders take yuv420p and would convert each RGB frame with a scaler context made for
        # that frame alone (PyAV's VideoFrame.reformat): most of their threads' CPU at 128 x 128. One
        # kept here is made once (0.36 -> 0.12 ms a 128 x 128 frame).
        self._to_yuv = VideoReformatter()

    async def recv(self) -> VideoFrame:
        if self._next is None:
            self._next = await self._first()
        self._learn_rtp_origin()
        try:
            frame = await self.output.frame_at(self._next)
        except PlayoutClosed:
            self.stop()
            raise MediaStreamError from None
        self.skipped_frames += frame.index - self._next
        self._next = frame.index + 1
        self._last_index = frame.index
        rgb = VideoFrame.from_ndarray(np.ascontiguousarray(frame.image), format="rgb24")
        video = self._to_yuv.reformat(rgb, format="yuv420p")
        video.pts = frame.index * VIDEO_PTS_PER_FRAME
        video.time_base = VIDEO_TIME_BASE
        return video

    async def _first(self) -> int:
        try:
            return await self.start.first_index()
        except PlayoutClosed:
            self.stop()
            raise MediaStreamError from None

    def frame_index(self, rtp_timestamp: int) -> int | None:
        """The output frame a received RTP timestamp belongs to (None until the origin is known)."""
        if self.rtp_origin is None:
            return None
        # Nearest frame: a decoder may hand back the timestamp a tick off (aiortc's VP8 path does).
        return ((rtp_timestamp - self.rtp_origin + VIDEO_PTS_PER_FRAME // 2) % 2**32) // VIDEO_PTS_PER_FRAME

    def _learn_rtp_origin(self) -> None:
        # aiortc adds a private random origin to our pts and keeps it in a local variable. Its send
        # loop is recv -> encode -> send every packet -> recv, so when recv is called again and
        # the packet count moved, the sender's last RTP timestamp belongs to our previous frame.
        if self.rtp_origin is not None or self.sender is None or self._last_index is None:
            return
        packets = getattr(self.sender, "_RTCRtpSender__packet_count", None)
        rtp = getattr(self.sender, "_RTCRtpSender__rtp_timestamp", None)
        if packets is None or rtp is None:
            raise RuntimeError("aiortc RTCRtpSender internals changed: cannot map client reports to frames")
        if packets > self._packets_seen:
            self.rtp_origin = (rtp - self._last_index * VIDEO_PTS_PER_FRAME) % 2**32
        self._packets_seen = packets


class PlayoutAudioTrack(MediaStreamTrack):
    kind = "audio"

    def __init__(self, start: TrackStart) -> None:
        super().__init__()
        self.start = start
        self.output = start.output
        self._frame_index: int | None = None  # next output frame to take audio from
        self._sample = 0  # output-timeline sample of ``_pending[0]``
        self._pending = np.zeros(0, np.int16)
        self._encoder = av.CodecContext.create("libopus", "w")
        self._encoder.sample_rate = TIMELINE_RATE
        self._encoder.format = "s16"
        self._encoder.layout = "mono"
        self._encoder.bit_rate = OPUS_BITRATE
        self._encoder.time_base = AUDIO_TIME_BASE
        self._encoder.options = {"application": "voip"}

    async def recv(self) -> av.Packet:
        try:
            if self._frame_index is None:
                self._frame_index = await self.start.first_index()
                self._sample = self._frame_index * SAMPLES_PER_FRAME
            while len(self._pending) < AUDIO_PACKET_SAMPLES:
                frame = await self.output.frame_at(self._frame_index)
                if frame.index != self._frame_index:  # fell out of history: restart at what is held
                    self._pending = np.zeros(0, np.int16)
                    self._sample = frame.index * SAMPLES_PER_FRAME
                self._pending = np.concatenate([self._pending, frame.audio])
                self._frame_index = frame.index + 1
        except PlayoutClosed:
            self.stop()
            raise MediaStreamError from None
        delay = self.output.deadline((self._sample + AUDIO_SEND_LAG_SAMPLES) / TIMELINE_RATE) - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        samples, self._pending = self._pending[:AUDIO_PACKET_SAMPLES], self._pending[AUDIO_PACKET_SAMPLES:]
        audio = AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="mono")
        audio.sample_rate = TIMELINE_RATE
        audio.pts = self._sample
        audio.time_base = AUDIO_TIME_BASE
        self._sample += AUDIO_PACKET_SAMPLES
        # Encoded here, on time: handed a raw frame, aiortc would encode it in its thread pool,
        # whose wake-up delay under CPU load becomes packet jitter. One 20 ms mono frame is ~0.1 ms.
        # Its pts (the encoder shifts it back by Opus's look-ahead) becomes the RTP timestamp.
        [packet] = self._encoder.encode(audio)
        return packet
