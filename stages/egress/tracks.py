"""WebRTC tracks that read a session's ``PlayoutOutput``: video at 90 kHz pts, audio at 48 kHz.

A/V sync. aiortc's RTCP sender report maps "now" (when a packet is sent) to that packet's RTP
timestamp, per track. So the receiver lines audio and video up correctly only if both tracks
send each frame at the wall time its pts stands for, from one origin. aiortc's own example
tracks each start their own ``time.time()`` clock at their first ``recv`` and its Opus encoder
counts samples from its first packet, so two tracks that start at different moments, or one
that sends a backlog in a burst, carry a fixed offset for the whole call. Here both tracks take
their pts from the playout output index on the session's timeline (frame ``i`` ⇒ video pts
``i·90000/fps``, audio sample ``i·48000/fps``: 3,750 and 2,000 at 24 fps, 3,600 and 1,920 at 25), both start at the same output frame (``TrackStart``), and each frame or 20 ms
audio packet is returned on its deadline on the playout clock (audio packets a constant 18 ms
after their first sample at 24 fps: ``audio_send_lag_samples``).
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
from charstream.stages.playout.yuv import FORMAT as YUV
from charstream.timeline import TIMELINE_RATE, Timeline

VIDEO_CLOCK_RATE = 90_000
AUDIO_PACKET_SAMPLES = 960  # 20 ms: one Opus frame per packet
OPUS_BITRATE = 64_000  # mono speech
VIDEO_TIME_BASE = fractions.Fraction(1, VIDEO_CLOCK_RATE)
AUDIO_TIME_BASE = fractions.Fraction(1, TIMELINE_RATE)


def video_pts_per_frame(timeline: Timeline) -> int:
    """Video pts ticks (90 kHz) per frame: 3,750 at 24 fps, 3,600 at 25."""
    if VIDEO_CLOCK_RATE % timeline.fps:
        raise ValueError(f"{timeline.fps} fps is not a whole number of 90 kHz video ticks per frame")
    return VIDEO_CLOCK_RATE // timeline.fps


def audio_send_lag_samples(timeline: Timeline) -> int:
    """How long after its first sample each 20 ms audio packet is sent.

    A packet often ends inside a frame not yet released: its last sample is available up to this many
    samples after the packet's start (880, 18.3 ms, at 24 fps; none at 25, where two packets fill a frame). Sending every packet that
    much after its start keeps the packets on an exact 20 ms grid (a sawtooth of send jitter would make
    the browser's audio jitter buffer, and with lip sync the video, wait longer); the cost is a constant
    lag of audio in the sender reports, within one frame.
    """
    per_frame = timeline.samples_per_frame
    return max(per_frame * ((AUDIO_PACKET_SAMPLES * k + AUDIO_PACKET_SAMPLES - 1) // per_frame) - AUDIO_PACKET_SAMPLES * k
               for k in range(math.lcm(per_frame, AUDIO_PACKET_SAMPLES) // AUDIO_PACKET_SAMPLES))  # one period


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
        self.pts_per_frame = video_pts_per_frame(self.output.timeline)
        self.sender: RTCRtpSender | None = None  # set by the server; used to learn the RTP origin
        self.rtp_origin: int | None = None  # RTP timestamp = origin + pts (mod 2**32)
        self.skipped_frames = 0  # frames this track fell behind on (slow encoder)
        self.output.video_format = YUV  # playout converts the frames off the event loop (ReleasedFrame.video)
        self._next: int | None = None
        self._last_index: int | None = None
        self._packets_seen = 0
        # The encoders take yuv420p and would convert each RGB frame with a scaler context made for
        # that frame alone (PyAV's VideoFrame.reformat): most of their threads' CPU at 128 x 128. Frames
        # playout released without their yuv420p planes are converted here, with one kept scaler.
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
        if frame.video is not None:  # converted off the event loop: wrapped, not copied
            video = VideoFrame.from_numpy_buffer(frame.video, format=YUV)
        else:
            rgb = VideoFrame.from_ndarray(np.ascontiguousarray(frame.image), format="rgb24")
            video = self._to_yuv.reformat(rgb, format=YUV)
        video.pts = frame.index * self.pts_per_frame
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
        return ((rtp_timestamp - self.rtp_origin + self.pts_per_frame // 2) % 2**32) // self.pts_per_frame

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
            self.rtp_origin = (rtp - self._last_index * self.pts_per_frame) % 2**32
        self._packets_seen = packets


class PlayoutAudioTrack(MediaStreamTrack):
    kind = "audio"

    def __init__(self, start: TrackStart) -> None:
        super().__init__()
        self.start = start
        self.output = start.output
        self.samples_per_frame = self.output.timeline.samples_per_frame
        self.send_lag = audio_send_lag_samples(self.output.timeline)
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
                self._sample = self._frame_index * self.samples_per_frame
            while len(self._pending) < AUDIO_PACKET_SAMPLES:
                frame = await self.output.frame_at(self._frame_index)
                if frame.index != self._frame_index:  # fell out of history: restart at what is held
                    self._pending = np.zeros(0, np.int16)
                    self._sample = frame.index * self.samples_per_frame
                self._pending = np.concatenate([self._pending, frame.audio])
                self._frame_index = frame.index + 1
        except PlayoutClosed:
            self.stop()
            raise MediaStreamError from None
        delay = self.output.deadline((self._sample + self.send_lag) / TIMELINE_RATE) - time.monotonic()
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
