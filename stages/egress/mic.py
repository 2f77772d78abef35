"""The user's microphone, handed from WebRTC to ingest (VAD).

Interface for ingest: a ``UserAudioQueue`` per session. Egress ``put``s every received mic frame
as a ``UserAudioFrame`` (48 kHz mono int16, 20 ms = 960 samples from a browser, stamped with the
wall-clock time it arrived); ingest awaits ``get()``. The queue is bounded: when ingest falls
behind, the oldest frame is dropped and counted (``dropped``), so a stalled VAD can never grow
memory, and egress never waits (aiortc's own receive queue is unbounded, so the mic track must
be drained at the rate it arrives). ``close()`` ends the stream: ``get()`` then raises
``UserAudioClosed`` once the queue is empty.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from dataclasses import dataclass

import numpy as np
import structlog
from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from av import AudioResampler

from charstream.timeline import TIMELINE_RATE

log = structlog.get_logger("egress.mic")


class UserAudioClosed(Exception):
    """The user's microphone stream ended."""


@dataclass
class UserAudioFrame:
    samples: np.ndarray  # int16 mono at 48 kHz
    received_at: float  # wall clock (time.time())


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


async def pump_microphone(track: MediaStreamTrack, sink: UserAudioQueue, session_id: str) -> None:
    """Read the remote mic track until it ends, resampled to 48 kHz mono int16, into ``sink``."""
    resampler = AudioResampler(format="s16", layout="mono", rate=TIMELINE_RATE)
    try:
        while True:
            frame = await track.recv()
            now = time.time()
            for out in resampler.resample(frame):
                sink.put(UserAudioFrame(out.to_ndarray().reshape(-1).astype(np.int16, copy=False), now))
    except MediaStreamError:
        log.info("mic_ended", session_id=session_id, received=sink.received, dropped=sink.dropped)
    finally:
        sink.close()
