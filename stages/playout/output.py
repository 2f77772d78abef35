"""The frames one session's playout released, as egress (and recorders) read them: by output index.

The output timeline is what the WebRTC tracks stamp as pts, so audio and video leave with one clock.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

import numpy as np

from charstream.timeline import CHARACTERS, Timeline
from charstream.transport.messages import TraceContext


class PlayoutClosed(Exception):
    """The session's playout ended; readers stop."""


@dataclass
class ReleasedFrame:
    index: int  # position on the output timeline: due at t0 + index / fps
    image: np.ndarray  # uint8 (H, W, 3) RGB
    audio: np.ndarray  # int16 (timeline.samples_per_frame,)
    chunk: int | None  # None for a hold frame (underrun)
    frame_in_chunk: int
    speaking: bool
    epoch: int
    trace: TraceContext | None
    first_speaking: bool  # the frame that got the turn's playout_first_speaking_frame stamp
    released_at: float  # wall clock (time.time()) of the release
    # the frame as yuv420p planes, uint8 (H * 3 / 2, W), where the output's reader asked for them
    # (``PlayoutOutput.video_format``) and playout had converted its chunk by then; else None
    video: np.ndarray | None = None


@dataclass
class FrameRecord:
    """What is remembered of a released frame after its pixels are gone (client-report lookups)."""

    index: int
    chunk: int | None
    frame_in_chunk: int
    first_speaking: bool
    trace: TraceContext | None
    released_at: float


class PlayoutOutput:
    """The frames one session's playout released: a bounded history read by output index.

    Readers keep their own cursor (``await frame_at(i)``) instead of a queue each, so a reader
    that starts late or falls behind costs no memory: it resumes at the oldest frame still held.
    """

    def __init__(self, history_frames: int = 48, record_frames: int | None = None,
                 timeline: Timeline = CHARACTERS) -> None:
        self.timeline = timeline  # the session's: what the tracks' pts and a frame's audio span follow
        self.history_frames = history_frames
        record_frames = record_frames if record_frames is not None else 30 * timeline.fps
        self._history: deque[ReleasedFrame] = deque(maxlen=history_frames)
        # Small per-frame records for longer: a client's report may come seconds after the frame.
        self._records: deque[FrameRecord] = deque(maxlen=record_frames)
        self.next_index = 0
        self.t0: float | None = None  # monotonic deadline of frame 0
        # the pixel format the video reader encodes ("yuv420p"), set by it: playout then converts each
        # chunk's frames off the event loop and releases them in it too (``ReleasedFrame.video``)
        self.video_format: str | None = None
        self.closed = False
        self._changed = asyncio.Event()
        self._started = asyncio.Event()

    def start(self, t0: float) -> None:
        self.t0 = t0
        self._started.set()

    async def wait_started(self) -> None:
        await self._started.wait()
        if self.closed:
            raise PlayoutClosed

    def deadline(self, seconds_of_media: float) -> float:
        """Monotonic time at which the given media time (from output frame 0) is due."""
        assert self.t0 is not None, "playout clock not started"
        return self.t0 + seconds_of_media

    def publish(self, frame: ReleasedFrame) -> None:
        self._history.append(frame)
        self._records.append(FrameRecord(frame.index, frame.chunk, frame.frame_in_chunk, frame.first_speaking,
                                         frame.trace, frame.released_at))
        self.next_index = frame.index + 1
        self._wake()

    async def frame_at(self, index: int) -> ReleasedFrame:
        """The frame at ``index`` once released; the oldest held one if ``index`` fell out of history."""
        while not self.closed and index >= self.next_index:
            changed = self._changed
            await changed.wait()
        if self.closed:
            raise PlayoutClosed
        oldest = self._history[0].index
        return self._history[max(index, oldest) - oldest]

    def record(self, index: int) -> FrameRecord | None:
        """The record of a released frame from the last ``record_frames``, or None."""
        if not self._records or not self._records[0].index <= index < self.next_index:
            return None
        return self._records[index - self._records[0].index]

    def close(self) -> None:
        self.closed = True
        self._started.set()
        self._wake()

    def _wake(self) -> None:
        # One event per release: waiters of this release wake, later waiters wait on the new one.
        self._changed.set()
        self._changed = asyncio.Event()
