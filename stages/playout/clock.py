"""The playhead behind playout's clock (the session's fps): which frame each tick releases, from a jitter buffer.

Chunks wait in ``buffer``; the clock plays them frame by frame. Its state says what a tick does:

- ``WAITING``: the buffer has not reached ``resume_depth`` (before the start, after running dry):
  hold the last frame with silence;
- ``PLAYING``: release the next frame of the chunk on screen, the next buffered chunk after it; an
  empty buffer there is an underrun (-> ``WAITING``), and so is a chunk on screen whose later part
  (``VideoChunk.offset``) has not arrived at the frame it starts at (-> ``WAITING`` until it does, or
  until a later chunk arrives: then the part was lost and the chunk ends there);
- ``HOLDING_ONSET``: the chunk on screen reached the frame where the placed speech takes over
  (docs/ARCHITECTURE.md, Turn-start rollback) and the speech's chunk is not there yet: hold.

The speech's chunk takes over at its own onset frame (the characters family: the speech starts inside a
chunk both versions share), or, ``rephase`` (a chunk-motion model), from its first frame: its chunks were
made from the onset on, so the listening chunk's later frames are dropped and the grid moves with it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from enum import Enum

import numpy as np

from charstream.stages.playout.onset import Onset
from charstream.stages.playout.output import ReleasedFrame
from charstream.stages.playout.stats import UnderrunCause
from charstream.timeline import CHARACTERS, Timeline
from charstream.transport.messages import VideoChunk


class ClockState(Enum):
    WAITING = "waiting"
    PLAYING = "playing"
    HOLDING_ONSET = "holding_onset"


class FrameParts:
    """A chunk's frames (or their yuv420p versions) as its parts arrive, in order, indexed without joining
    them. ``len``: the frames there so far."""

    def __init__(self, frames: np.ndarray | None = None) -> None:
        self._parts: list[tuple[int, np.ndarray]] = []
        self._count = 0
        if frames is not None:
            self.add(0, frames)

    def add(self, offset: int, frames: np.ndarray) -> None:
        self._parts.append((offset, frames))
        self._count += len(frames)

    def __len__(self) -> int:
        return self._count

    def get(self, index: int) -> np.ndarray | None:
        for offset, frames in self._parts:
            if offset <= index < offset + len(frames):
                return frames[index - offset]
        return None


@dataclass(frozen=True)
class SpeechStart:
    """Where the speech the last turn start placed begins: frame ``frame`` of chunk ``chunk`` of ``epoch``."""

    epoch: int
    chunk: int
    frame: int


@dataclass(frozen=True)
class Tick:
    """What one tick released, and what happened on the way."""

    frame: ReleasedFrame
    resumed: bool  # the clock started playing after waiting for chunks (conditioning's pacing anchor)
    underrun: UnderrunCause | None  # the buffer ran dry at this frame, for this cause
    held: UnderrunCause | None  # a hold frame, released for an underrun of this cause


class PlayoutClock:
    """The jitter buffer and the playhead: ``next_frame`` once per tick, ``rollback`` on a turn start."""

    def __init__(self, target_depth_chunks: int, timeline: Timeline = CHARACTERS, rephase: bool = False) -> None:
        self.timeline = timeline  # the session's: frames per chunk, audio per frame
        self.rephase = rephase  # the speech's chunk plays from its first frame at the onset
        self.target_depth_chunks = target_depth_chunks
        self.state = ClockState.WAITING
        self.epoch = 0  # bumped by each rollback; chunks of older epochs are stale
        self.buffer: deque[VideoChunk] = deque()
        self.playing: VideoChunk | None = None
        self.position = 0  # next frame of ``playing``
        self.last_committed: int | None = None  # last chunk whose frames started leaving
        # Buffered chunks needed to leave WAITING: the target depth behind the first, or one where
        # waiting would only lengthen a freeze (speech comes at the agent's pace; a rollback's speech).
        self.resume_depth = target_depth_chunks + 1
        self.speech: SpeechStart | None = None
        self.speech_pending = False  # a turn start's speech has not begun playing yet
        self._hold_cause = UnderrunCause.LISTENING  # of the underrun being held
        self._last_image: np.ndarray | None = None
        # chunks' frames (their parts) and the same as yuv420p (``add_video``), by buffered chunk; the playing
        # chunk's; the last released
        self._frames: dict[int, FrameParts] = {}
        self._videos: dict[int, FrameParts] = {}
        self._playing_frames = FrameParts()
        self._playing_video = FrameParts()
        self._last_video: np.ndarray | None = None
        self._stamped_turns: set[int] = set()
        self._changed = asyncio.Event()

    # --- the buffer ----------------------------------------------------------------------------

    def push(self, chunk: VideoChunk) -> None:
        self.buffer.append(chunk)
        self._frames[id(chunk)] = FrameParts(chunk.frames)
        self._videos[id(chunk)] = FrameParts()
        self._notify()

    def extend(self, part: VideoChunk) -> VideoChunk | None:
        """A later part of a chunk on screen or buffered: its frames follow the chunk's. Returns the chunk, or
        None where there is none it continues (dropped by a rollback, played out, or not the part next)."""
        for chunk in (self.playing, *self.buffer):
            if chunk is None or (chunk.session_id, chunk.epoch, chunk.chunk) != (part.session_id, part.epoch, part.chunk):
                continue
            frames = self._playing_frames if chunk is self.playing else self._frames[id(chunk)]
            if len(frames) != part.offset or part.frames.shape[1:] != chunk.frames.shape[1:]:
                return None
            frames.add(part.offset, part.frames)
            self._notify()
            return chunk
        return None

    def add_video(self, chunk: VideoChunk, video: np.ndarray, offset: int = 0) -> None:
        """``chunk``'s frames from ``offset`` as yuv420p, converted after they arrived: its frames released from
        now on carry them. A chunk dropped or played out meanwhile has no use for them."""
        if chunk is self.playing:
            self._playing_video.add(offset, video)
        elif id(chunk) in self._videos and any(c is chunk for c in self.buffer):
            self._videos[id(chunk)].add(offset, video)

    async def wait_changed(self) -> None:
        """Until a chunk is pushed, taken to play or dropped."""
        event = self._changed
        await event.wait()

    def frames_left_on_screen(self) -> int:
        """Frames of the playing chunk not released yet (0 with none playing)."""
        return self.timeline.frames_per_chunk - self.position if self.playing is not None else 0

    def chunk_on_screen(self) -> int | None:
        return self.playing.chunk if self.playing is not None and self.position < self.timeline.frames_per_chunk else None

    def onset_ahead(self) -> bool:
        """A turn start's speech is placed inside a chunk and has not begun: that chunk plays only up to it."""
        return self.speech_pending and self.speech is not None and self.speech.frame > 0

    def rollback(self, place: Onset | None, turn_start: bool) -> tuple[list[VideoChunk], list[VideoChunk], int]:
        """Keep the unplayed chunks before ``place`` (with an onset frame: its chunk's listening frames
        before it too), drop the rest and bump the epoch; no ``place``: every unplayed chunk goes.
        Returns the kept and dropped chunks and the last chunk kept whole (upstream regenerates after it)."""
        keep = 0 if place is None else place.kept + (place.onset > 0 and place.chunk != self.chunk_on_screen())
        kept = [self.buffer.popleft() for _ in range(min(keep, len(self.buffer)))]
        dropped = list(self.buffer)
        self.buffer = deque(kept)
        for chunk in dropped:
            self._frames.pop(id(chunk), None)
            self._videos.pop(id(chunk), None)
        self.epoch += 1
        self.resume_depth = 1  # speech should start as soon as its first chunk exists, not after a re-buffer
        if self.state is ClockState.HOLDING_ONSET:  # an earlier placement's speech: its chunk is gone
            self.state = ClockState.PLAYING
        self.speech_pending = turn_start
        if place is None:
            last = self.last_committed if self.last_committed is not None else -1
            self.speech = SpeechStart(self.epoch, last + 1, 0)
        else:
            last = place.chunk - 1
            self.speech = SpeechStart(self.epoch, place.chunk, place.onset)
        self._notify()
        return kept, dropped, last

    # --- the ticks -----------------------------------------------------------------------------

    def next_frame(self, index: int, now: float) -> Tick:
        """The frame at output ``index`` (released at wall clock ``now``)."""
        resumed, underrun = False, None
        if self.playing is None or self.position == self.timeline.frames_per_chunk:
            ended, self.playing = self.playing, None
            if self.state is ClockState.WAITING and len(self.buffer) >= self.resume_depth:
                self.state, resumed = ClockState.PLAYING, True
            if self.state is ClockState.PLAYING and self.buffer:
                self._play(self.buffer.popleft())
                self.position = 0
                self.last_committed = self.playing.chunk
            elif self.state is ClockState.PLAYING:
                self.state = ClockState.WAITING
                if ended is not None and ended.speaking:
                    # Speech comes at the agent's pace: waiting for depth would only make the freeze
                    # longer. Its next chunk plays as it lands; the hold becomes the turn's slack.
                    self.resume_depth = 1
                speaking = ended is not None and ended.speaking and ended.epoch == self.epoch
                underrun = UnderrunCause.ONSET if self.speech_pending else \
                    UnderrunCause.SPEECH if speaking else UnderrunCause.LISTENING
        elif self._onset_due():  # the placed speech takes over its chunk at the onset frame
            speech = self.speech
            if self.buffer and (self.buffer[0].epoch, self.buffer[0].chunk) == (speech.epoch, speech.chunk):
                self._play(self.buffer.popleft())
                self.state = ClockState.PLAYING
                if self.rephase:
                    self.position = 0
            elif self.state is not ClockState.HOLDING_ONSET:
                self.state = ClockState.HOLDING_ONSET
                underrun = UnderrunCause.ONSET
        elif self.position >= len(self._playing_frames):  # the chunk's next part has not arrived
            if self.buffer:  # a later chunk has: parts come in order, so the rest was lost; the chunk ends here
                self.position = self.timeline.frames_per_chunk
                return self.next_frame(index, now)
            if self.state is ClockState.PLAYING:
                self.state = ClockState.WAITING
                speaking = self.playing.speaking and self.playing.epoch == self.epoch
                underrun = UnderrunCause.ONSET if self.speech_pending else \
                    UnderrunCause.SPEECH if speaking else UnderrunCause.LISTENING
        elif self.state is ClockState.WAITING:  # it has: the chunk plays on
            self.state = ClockState.PLAYING
        if underrun is not None:
            self._hold_cause = underrun
        if self.state is not ClockState.PLAYING:  # hold the last frame, play silence
            image = self._last_image if self._last_image is not None else np.zeros((16, 16, 3), np.uint8)
            silence = np.zeros(self.timeline.samples_per_frame, np.int16)
            frame = ReleasedFrame(index, image, silence, None, 0, False, self.epoch,
                                  None, False, now, self._last_video)
            return Tick(frame, resumed, underrun, self._hold_cause)
        return Tick(self._fresh_frame(index, now), resumed, underrun, None)

    def _fresh_frame(self, index: int, now: float) -> ReleasedFrame:
        chunk, position = self.playing, self.position
        assert chunk is not None
        self.position += 1
        image = self._playing_frames.get(position)
        self._last_image = image
        self._last_video = self._playing_video.get(position)
        span = self.timeline.samples_per_frame
        audio = chunk.audio[position * span:(position + 1) * span]
        # The speech a rollback placed starts at its onset frame; the frames before it are silent.
        speech = self.speech
        onset = speech.frame if not self.rephase and speech is not None and \
            (speech.epoch, speech.chunk) == (chunk.epoch, chunk.chunk) else 0
        speaking = chunk.speaking and position >= onset
        first_speaking = False
        turn = chunk.trace.turn_id
        if position == onset and speaking and turn is not None and turn not in self._stamped_turns:
            self._stamped_turns.add(turn)
            chunk.trace.stamp("playout_first_speaking_frame", now)
            first_speaking = True
        return ReleasedFrame(index, image, audio, chunk.chunk, position, speaking, chunk.epoch, chunk.trace,
                             first_speaking, now, self._last_video)

    def _play(self, chunk: VideoChunk) -> None:
        self.playing = chunk
        frames, video = self._frames.pop(id(chunk), None), self._videos.pop(id(chunk), None)
        self._playing_frames = FrameParts(chunk.frames) if frames is None else frames
        self._playing_video = FrameParts() if video is None else video
        if chunk.epoch == self.epoch:  # the rollback's speech has begun (the chunks it kept are of the epoch before)
            self.resume_depth = self.target_depth_chunks + 1
            self.speech_pending = False
        self._notify()

    def _onset_due(self) -> bool:
        """The listening version of the placed speech's chunk is at the onset frame."""
        speech, playing = self.speech, self.playing
        return speech is not None and speech.frame > 0 and playing is not None and playing.epoch < speech.epoch \
            and playing.chunk == speech.chunk and self.position == speech.frame

    def _notify(self) -> None:
        # One event per change: waiters of this change wake, later waiters wait on the new one.
        self._changed.set()
        self._changed = asyncio.Event()
