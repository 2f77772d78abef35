"""Playout: the session's jitter buffer and its 24 fps clock.

Chunks (4 frames + their 8,000 audio samples) arrive from decode into a bounded buffer. Once
``target_depth_chunks`` chunks wait behind the first one, the clock starts: frame ``n`` of the
output timeline is released at ``t0 + n / 24`` (absolute deadlines on the monotonic clock, so
sleep error never accumulates), together with exactly its 2,000 samples. The buffer therefore
holds ``target_depth_chunks × 166.7 ms`` of media ahead of the playhead: an upstream stall
shorter than that is absorbed. When the buffer runs dry the clock keeps going: the last frame is
held with silence (an underrun, counted) until the buffer is back at its target depth -- or, when
it ran dry in the middle of speech, until the next chunk lands (speech arrives at the agent's pace:
the buffer cannot refill faster, so waiting for depth only lengthens the freeze).

Backpressure: ``process`` waits while the buffer holds ``max_depth_chunks`` (upstream gets no
credit meanwhile). A rollback wakes that wait (the waiting chunk is then stale), so a runner should
deliver ``control`` while ``process`` waits; a dispatch loop that awaits ``process`` before taking
control delays a turn start by up to one chunk (166.7 ms) whenever the buffer is full.

Released frames go to a ``PlayoutOutput``: a bounded history that egress tracks (and recorders)
read by output index. The output timeline is what the WebRTC tracks stamp as pts, so audio and
video leave with one clock.

Turn-start rollback (docs/ARCHITECTURE.md, Turn-start rollback): on ``Control(TURN_START)`` playout
places the speech at the first frame that its first chunk can reach in time -- the estimate of that
chunk's own production (stages/speech_estimate.py: its step starts once it is encoded and the step
busy with the last listening chunk is done, then a step and a delivery, each the 90th percentile of
recent chunks' measured parts, plus an allowance learned from what recent turns' speech took beyond
its estimate), with the chunk after it due no earlier than one step (or encode) after that -- and
never before ``earliest_chunk``, the furthest rewind the diffusion ring undoes exactly. The speech's
chunks are measured against the schedule placed (logged: ``playout_speech_arrived``,
``playout_turn_speech``). The buffered chunks before that frame's chunk are kept and play on (no
hole); the rest are dropped, and ``Control(ROLLBACK, chunk=last_kept, epoch=e+1, detail={"onset_frame":
k, "due_at": t})`` is sent: the speech starts at frame ``k`` of chunk
``last_kept + 1`` (its leading frames silent), which is due at wall clock ``t``. That frame gets the
turn's ``playout_first_speaking_frame`` stamp. On ``INTERRUPT`` (a barge-in) every unplayed chunk
is dropped. Chunks of older epochs arriving afterwards are discarded; if the first new chunk comes
late anyway, it plays as soon as it arrives instead of waiting for the full target depth.

Whenever the clock (re)starts playing after waiting for chunks, playout sends ``Control(CLOCK,
chunk=c, detail={"due_at": t})``: conditioning paces listening chunks from it.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from dataclasses import dataclass

import numpy as np

from charstream.stages.base import Stage, StageContext
from charstream.stages.config import PlayoutConfig
from charstream.stages.metrics import SessionMetrics
from charstream.stages.speech_estimate import Estimate, SpeechEstimator
from charstream.stages.tracing import TurnTracer
from charstream.timeline import (
    CHUNK_SECONDS,
    FRAMES_PER_CHUNK,
    SAMPLES_PER_CHUNK,
    SAMPLES_PER_FRAME,
    TIMELINE_RATE,
    VIDEO_FPS,
)
from charstream.transport.messages import Control, ControlKind, Message, TraceContext, VideoChunk

FRAME_SECONDS = 1.0 / VIDEO_FPS
UNDERRUN_CAUSES = ("onset", "speech", "listening")  # PlayoutStats' <cause>_underruns and <cause>_underrun_frames


class PlayoutClosed(Exception):
    """The session's playout ended; readers stop."""


@dataclass
class ReleasedFrame:
    index: int  # position on the output timeline: due at t0 + index / 24
    image: np.ndarray  # uint8 (H, W, 3) RGB
    audio: np.ndarray  # int16 (SAMPLES_PER_FRAME,)
    chunk: int | None  # None for a hold frame (underrun)
    frame_in_chunk: int
    speaking: bool
    epoch: int
    trace: TraceContext | None
    first_speaking: bool  # the frame that got the turn's playout_first_speaking_frame stamp
    released_at: float  # wall clock (time.time()) of the release


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

    def __init__(self, history_frames: int = 48, record_frames: int = 30 * VIDEO_FPS) -> None:
        self.history_frames = history_frames
        self._history: deque[ReleasedFrame] = deque(maxlen=history_frames)
        # Small per-frame records for longer: a client's report may come seconds after the frame.
        self._records: deque[FrameRecord] = deque(maxlen=record_frames)
        self.next_index = 0
        self.t0: float | None = None  # monotonic deadline of frame 0
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


@dataclass
class PlayoutStats:
    """Per-session playout figures; ``summary()`` is what reports and fleet queries read."""

    depth: int = 0
    max_depth_seen: int = 0
    frames_released: int = 0
    fresh_frames: int = 0  # released frames that came from a chunk (not held)
    underruns: int = 0  # times the buffer ran dry
    underrun_frames: int = 0  # hold frames released during underruns
    # The same by cause, decided where the underrun is: ``onset`` -- a turn start's speech not there
    # when its frame was due (placed too early, or nothing could be placed); ``speech`` -- a speaking
    # chunk of the turn late in the middle of its speech; ``listening`` -- anything else (a listening
    # chunk late, after a barge-in).
    onset_underruns: int = 0
    speech_underruns: int = 0
    listening_underruns: int = 0
    onset_underrun_frames: int = 0
    speech_underrun_frames: int = 0
    listening_underrun_frames: int = 0
    late_chunks: int = 0  # chunks that arrived while playout was starved for them
    late_ticks: int = 0  # frames released more than one frame period after their deadline
    stale_chunks: int = 0  # chunks of an older epoch, discarded
    invalid_chunks: int = 0  # malformed chunks, discarded with an error log
    rollbacks: int = 0
    rolled_back_chunks: int = 0  # unplayed chunks dropped by rollbacks
    kept_chunks: int = 0  # unplayed chunks a turn start kept to play before the speech
    late_speech: int = 0  # turn starts whose first speech chunk arrived after it was due
    elapsed_s: float = 0.0  # from the clock's start to the end of the last released frame

    @property
    def achieved_fps(self) -> float:
        """Fresh frames per second of wall time: 24 when nothing stalled, less for each held frame."""
        return self.fresh_frames / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def count_underrun(self, cause: str) -> None:
        """The buffer ran dry for ``cause`` (one of ``UNDERRUN_CAUSES``)."""
        self._count(cause, "underruns")

    def count_held(self, cause: str) -> None:
        """A hold frame released for an underrun of ``cause``."""
        self._count(cause, "underrun_frames")

    def _count(self, cause: str, what: str) -> None:
        if cause not in UNDERRUN_CAUSES:
            raise ValueError(f"underrun cause {cause!r} is not one of {UNDERRUN_CAUSES}")
        setattr(self, what, getattr(self, what) + 1)
        setattr(self, f"{cause}_{what}", getattr(self, f"{cause}_{what}") + 1)

    def summary(self) -> dict[str, float | int]:
        data = {k: v for k, v in self.__dict__.items()}
        data["achieved_fps"] = round(self.achieved_fps, 3)
        return data


@dataclass
class Placement:
    """Where a turn's speech starts: frame ``onset`` of chunk ``chunk``, after ``kept`` unplayed chunks
    (the frames of ``chunk`` before the onset are its listening version, already made)."""

    kept: int
    chunk: int
    onset: int
    estimate: Estimate  # what it was placed by: when the speech's first chunk arrives


@dataclass
class _SpeechPlan:
    """The placed speech's schedule: its chunk ``k`` is expected ``k`` chunks after the first (less the
    onset frames), the first at ``expected_at`` (monotonic; the estimate without its allowance)."""

    epoch: int
    chunk: int
    onset: int
    expected_at: float
    placed_at: float  # wall clock of the placement
    started: bool = False  # a chunk of it arrived


class PlayoutStage(Stage):
    """Consumes ``VideoChunk``; releases frames + audio on the 24 fps clock into ``output``."""

    name = "playout"
    control_during_process = True  # a turn start must not wait behind a chunk waiting for room

    def __init__(self, config: PlayoutConfig, output: PlayoutOutput | None = None,
                 tracer: TurnTracer | None = None) -> None:
        self.config = config
        # What egress reads; the session hands in the one it serves (None: a fresh one of our own).
        self.output = output if output is not None else PlayoutOutput(config.history_frames)
        self.tracer = tracer
        self.stats = PlayoutStats()
        self.epoch = 0
        self.last_committed: int | None = None  # last chunk whose frames started leaving
        self._buffer: deque[VideoChunk] = deque()
        self._buffer_changed = asyncio.Event()
        self._playing: VideoChunk | None = None
        self._position = 0  # next frame of ``_playing``
        self._last_image: np.ndarray | None = None
        self._starved = True  # waiting for depth (at start and after an underrun)
        self._resume_depth = self.config.target_depth_chunks + 1
        self._stamped_turns: set[int] = set()
        self._control_seq = 0
        # The parts of recent chunks' production, and what turn starts took beyond their estimate.
        self._estimator = SpeechEstimator(initial_allowance_s=config.initial_allowance_s)
        self._plan: _SpeechPlan | None = None
        self._onset: tuple[int, int, int] | None = None  # (epoch, chunk, frame) where placed speech starts
        self._speech_due: float | None = None  # monotonic deadline of the placed speech chunk's first frame
        self._resumed = False  # the clock just started playing after waiting: tell conditioning (CLOCK)
        self._holding = False  # at the placed speech's onset frame, its chunk not there yet: holding
        self._speech_pending = False  # a turn start's speech has not begun playing yet
        self._hold_cause = UNDERRUN_CAUSES[-1]  # the cause of the underrun being held
        self._metrics: SessionMetrics | None = None
        self._ctx: StageContext | None = None

    async def setup(self, ctx: StageContext) -> None:
        self._resume_depth = self.config.target_depth_chunks + 1  # the config refused a depth beyond the buffer
        self._ctx = ctx
        self._metrics = SessionMetrics(ctx.session_id)

    # --- input ---------------------------------------------------------------------------------

    async def process(self, msg: Message, ctx: StageContext) -> None:
        if not isinstance(msg, VideoChunk):
            ctx.log.error("playout_unexpected_message", type=type(msg).__name__)
            return
        problem = _check_chunk(msg)
        if problem:
            self.stats.invalid_chunks += 1
            ctx.log.error("playout_invalid_chunk", chunk=msg.chunk, problem=problem)
            return
        self._measure(msg)
        # Waiting for room is the backpressure: while we wait, upstream gets no credit.
        while len(self._buffer) >= self.config.max_depth_chunks:
            await self._wait_buffer_change()
        if msg.epoch < self.epoch:  # checked after the wait: a rollback may have happened meanwhile
            self.stats.stale_chunks += 1
            return
        if msg.epoch > self.epoch:
            ctx.log.warning("playout_epoch_ahead", chunk=msg.chunk, epoch=msg.epoch, playout_epoch=self.epoch)
            self.epoch = msg.epoch
        self._follow_speech(msg, ctx)
        if self._starved and self.output.t0 is not None:
            self.stats.late_chunks += 1
        self._buffer.append(msg)
        self._set_depth()
        self._notify_buffer()

    async def control(self, msg: Control, ctx: StageContext) -> None:
        if msg.kind in (ControlKind.TURN_START, ControlKind.INTERRUPT):
            self._end_turn(ctx)  # the speech before is over: its errors count before the next estimate
        if msg.kind == ControlKind.TURN_START:
            await self.rollback(ctx, ControlKind.TURN_START, self._place_speech(msg.detail))
        elif msg.kind == ControlKind.INTERRUPT:
            await self.rollback(ctx, ControlKind.INTERRUPT)

    def _measure(self, chunk: VideoChunk) -> None:
        """Record the parts of the chunk's production (its stamps, and its arrival now)."""
        self._estimator.observe(chunk.trace.stamps, time.time())

    def _follow_speech(self, chunk: VideoChunk, ctx: StageContext) -> None:
        """Measure the placed speech's chunks against its schedule; its end ends the turn's errors."""
        plan = self._plan
        if plan is None or chunk.epoch != plan.epoch or chunk.chunk < plan.chunk:
            return
        if not chunk.speaking:
            if plan.started:  # the turn's speech is over
                self._end_turn(ctx)
            return
        now = time.monotonic()
        k = chunk.chunk - plan.chunk
        error = now - (plan.expected_at + (k * CHUNK_SECONDS - plan.onset * FRAME_SECONDS if k else 0.0))
        self._estimator.speech_arrived(error)
        plan.started = True
        if k == 0 and self._speech_due is not None:
            margin = self._speech_due - now
            self.stats.late_speech += margin < 0
            stamps = chunk.trace.stamps
            ready, done = stamps.get("conditioning_ready"), stamps.get("diffusion_done")
            ctx.log.info("playout_speech_arrived", chunk=chunk.chunk, margin_ms=round(margin * 1e3, 1),
                         after_estimate_ms=round(error * 1e3, 1),
                         # the parts it took, as the estimate has them
                         encoded_after_ms=None if ready is None else round((ready - plan.placed_at) * 1e3, 1),
                         step_ms=None if ready is None or done is None else round((done - ready) * 1e3, 1),
                         delivery_ms=None if done is None else round((time.time() - done) * 1e3, 1))
            self._speech_due = None

    def _end_turn(self, ctx: StageContext | None) -> None:
        """The placed speech is over (or replaced): what it took beyond its estimate feeds the allowance."""
        self._plan = None
        turn = self._estimator.end_turn()
        if turn is not None and ctx is not None:
            ctx.log.info("playout_turn_speech", chunks=turn.chunks, first_error_ms=round(turn.first_s * 1e3, 1),
                         p90_error_ms=round(turn.p90_s * 1e3, 1), max_error_ms=round(turn.max_s * 1e3, 1),
                         allowance_ms=round(self._estimator.allowance_s * 1e3, 1))

    def _place_speech(self, detail: dict) -> Placement | None:
        """The first frame a turn's first speech chunk can reach in time (None: no estimate -- no clock,
        starved, or nothing measured yet -- so every unplayed chunk goes and the speech plays when it comes)."""
        t0 = self.output.t0
        if t0 is None or self._starved or not self._estimator.measured or not detail:  # (the test card sends no detail)
            return None
        encode_s = float(detail.get("encode_s") or 0.0)
        last_emit = detail.get("last_emit_at")
        estimate = self._estimator.estimate(time.time(), encode_s, None if last_emit is None else float(last_emit))
        ready_s = estimate.ready_s
        # Frames from the next one released to the first frame whose deadline the chunk can meet ...
        ahead = max(0, math.ceil((time.monotonic() + ready_s - t0) * VIDEO_FPS) - self.output.next_index)
        playing = self._playing
        left = self._frames_left_on_screen()
        # ... and whose next chunk, made one step (or encode) after it, is not due before it is there.
        interval = max(estimate.step_s, encode_s)
        next_needed = time.monotonic() + ready_s + interval
        while t0 + (self.output.next_index + _next_boundary(ahead, left)) / VIDEO_FPS < next_needed:
            ahead += 1
        first = playing.chunk + 1 if playing is not None else self._buffer[0].chunk
        if ahead < left:  # within the chunk on screen
            place = Placement(0, playing.chunk, self._position + ahead, estimate)
        else:
            kept, onset = divmod(ahead - left, FRAMES_PER_CHUNK)
            place = Placement(kept, first + kept, onset, estimate)  # (buffered chunks are consecutive)
        earliest = detail.get("earliest_chunk")
        if earliest is not None and place.chunk < int(earliest):  # a rewind that far would not be exact
            place = Placement(int(earliest) - first, int(earliest), 0, estimate)
        if place.kept > len(self._buffer) or (place.kept == len(self._buffer) and place.onset):
            # not enough made ahead: the speech will be late whatever we do
            place = Placement(len(self._buffer), first + len(self._buffer), 0, estimate)
        return place

    async def rollback(self, ctx: StageContext, reason: str = ControlKind.TURN_START,
                       place: Placement | None = None) -> Control:
        """Keep the unplayed chunks before ``place`` (with an onset frame: its chunk's listening frames
        before it too), drop the rest, bump the epoch and tell upstream where to regenerate from: the
        chunk after the last one kept whole. No ``place``: every unplayed chunk goes."""
        keep = 0 if place is None else place.kept + (place.onset > 0 and place.chunk != self._chunk_on_screen())
        kept = [self._buffer.popleft() for _ in range(min(keep, len(self._buffer)))]
        dropped = [c.chunk for c in self._buffer]
        self._buffer = deque(kept)
        self.epoch += 1
        self.stats.rollbacks += 1
        self.stats.rolled_back_chunks += len(dropped)
        self.stats.kept_chunks += len(kept)
        # Speech should start as soon as its first chunk exists, not after a full re-buffer.
        self._resume_depth = 1
        self._holding = False  # a hold for an earlier placement's speech ends: its chunk is gone
        self._speech_pending = reason == ControlKind.TURN_START
        self._set_depth()
        self._notify_buffer()
        self._control_seq += 1
        if place is None:
            last = self.last_committed if self.last_committed is not None else -1
            self._onset, self._speech_due, self._plan = (self.epoch, last + 1, 0), None, None
            detail: dict[str, str | int | float | None] = {"onset_frame": 0}
        else:
            last = place.chunk - 1
            self._onset = (self.epoch, place.chunk, place.onset)
            # Deadlines of the chunk's first frame (conditioning's anchor) and of the onset frame.
            left = self._frames_left_on_screen()
            start = self.output.next_index + (
                -self._position if place.chunk == self._chunk_on_screen() else left + FRAMES_PER_CHUNK * place.kept)
            self._speech_due = self.output.t0 + (start + place.onset) / VIDEO_FPS
            placed_at = time.time()
            self._plan = _SpeechPlan(self.epoch, place.chunk, place.onset, time.monotonic() + place.estimate.expected_s,
                                     placed_at)
            detail = {"onset_frame": place.onset, "placed_at": placed_at,  # conditioning logs the control's hop
                      "due_at": placed_at + self.output.t0 + start / VIDEO_FPS - time.monotonic()}
        detail.update(reason=str(reason), dropped=len(dropped), kept=len(kept))
        rollback = Control(ctx.session_id, self._control_seq, ControlKind.ROLLBACK, chunk=last, epoch=self.epoch,
                           detail=detail)
        ctx.log.info("playout_rollback", last_kept=last, epoch=self.epoch, kept=[c.chunk for c in kept],
                     dropped=dropped, onset_frame=detail["onset_frame"], reason=str(reason),
                     due_in_ms=None if self._speech_due is None else round((self._speech_due - time.monotonic()) * 1e3, 1),
                     **({} if place is None else place.estimate.fields()))
        await ctx.send_control(rollback)
        return rollback

    def _frames_left_on_screen(self) -> int:
        """Frames of the playing chunk not released yet (0 with none playing)."""
        return FRAMES_PER_CHUNK - self._position if self._playing is not None else 0

    def _chunk_on_screen(self) -> int | None:
        return self._playing.chunk if self._playing is not None and self._position < FRAMES_PER_CHUNK else None

    # --- the clock -----------------------------------------------------------------------------

    async def run(self, ctx: StageContext) -> None:
        while len(self._buffer) < self._resume_depth:
            await self._wait_buffer_change()
        t0 = time.monotonic()  # the tracks pace audio packets on this same clock
        self.output.start(t0)
        index = 0
        try:
            while True:
                deadline = t0 + index * FRAME_SECONDS
                delay = deadline - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                elif -delay > FRAME_SECONDS:
                    self.stats.late_ticks += 1
                frame = self._next_frame(index)
                self.output.publish(frame)
                if self._resumed:  # conditioning paces listening chunks from this
                    self._resumed = False
                    await self._send_clock(ctx, frame, deadline)
                self.stats.frames_released += 1
                self.stats.elapsed_s = time.monotonic() - t0 + FRAME_SECONDS
                if frame.first_speaking and self.tracer is not None and frame.trace is not None:
                    self.tracer.merge(frame.trace)
                if index % VIDEO_FPS == 0 and self._metrics is not None:
                    self._metrics.set_fps(self.stats.achieved_fps)
                index += 1
        finally:
            self.output.close()

    def _next_frame(self, index: int) -> ReleasedFrame:
        now = time.time()
        if self._playing is None or self._position == FRAMES_PER_CHUNK:
            ended, self._playing = self._playing, None
            if self._starved and len(self._buffer) >= self._resume_depth:
                self._starved, self._resumed = False, True
            if not self._starved and self._buffer:
                self._play(self._buffer.popleft())
                self._position = 0
                self.last_committed = self._playing.chunk
            elif not self._starved:
                self._starved = True
                if ended is not None and ended.speaking:
                    # Speech comes at the agent's pace: waiting for depth would only make the freeze
                    # longer. Its next chunk plays as it lands; the hold becomes the turn's slack.
                    self._resume_depth = 1
                speaking = ended is not None and ended.speaking and ended.epoch == self.epoch
                self._underrun(index, "onset" if self._speech_pending else "speech" if speaking else "listening")
        elif self._onset_due():  # the placed speech takes over its chunk at the onset frame
            if self._buffer and (self._buffer[0].epoch, self._buffer[0].chunk) == self._onset[:2]:
                self._play(self._buffer.popleft())
                self._holding = False
            elif not self._holding:
                self._holding = True
                self._underrun(index, "onset")
        chunk = None if self._holding else self._playing
        if chunk is None:  # underrun: hold the last frame, play silence
            self.stats.count_held(self._hold_cause)
            image = self._last_image if self._last_image is not None else np.zeros((16, 16, 3), np.uint8)
            return ReleasedFrame(index, image, np.zeros(SAMPLES_PER_FRAME, np.int16), None, 0, False, self.epoch,
                                 None, False, now)
        position = self._position
        self._position += 1
        self.stats.fresh_frames += 1
        image = chunk.frames[position]
        self._last_image = image
        audio = chunk.audio[position * SAMPLES_PER_FRAME:(position + 1) * SAMPLES_PER_FRAME]
        first_speaking = False
        turn = chunk.trace.turn_id
        # The speech a rollback placed starts at its onset frame; the frames before it are silent.
        onset = self._onset[2] if self._onset is not None and self._onset[:2] == (chunk.epoch, chunk.chunk) else 0
        speaking = chunk.speaking and position >= onset
        if position == onset and speaking and turn is not None and turn not in self._stamped_turns:
            self._stamped_turns.add(turn)
            chunk.trace.stamp("playout_first_speaking_frame", now)
            first_speaking = True
        return ReleasedFrame(index, image, audio, chunk.chunk, position, speaking, chunk.epoch, chunk.trace,
                             first_speaking, now)

    def _play(self, chunk: VideoChunk) -> None:
        self._playing = chunk
        if chunk.epoch == self.epoch:  # the rollback's speech has begun (the chunks it kept are of the epoch before)
            self._resume_depth = self.config.target_depth_chunks + 1
            self._speech_pending = False
        self._set_depth()
        self._notify_buffer()

    def _onset_due(self) -> bool:
        """The listening version of the placed speech's chunk is at the onset frame."""
        onset, playing = self._onset, self._playing
        return onset is not None and onset[2] > 0 and playing is not None and playing.epoch < onset[0] \
            and playing.chunk == onset[1] and self._position == onset[2]

    def _underrun(self, index: int, cause: str) -> None:
        self.stats.count_underrun(cause)
        self._hold_cause = cause
        if self._metrics is not None:
            self._metrics.underrun()
        if self._ctx is not None:
            self._ctx.log.warning("playout_underrun", frame=index, cause=cause, underruns=self.stats.underruns)

    async def _send_clock(self, ctx: StageContext, frame: ReleasedFrame, deadline: float) -> None:
        """Tell conditioning when the chunk that just started playing was due (its pacing anchor)."""
        if frame.chunk is None or frame.frame_in_chunk != 0:
            return
        self._control_seq += 1
        await ctx.send_control(Control(ctx.session_id, self._control_seq, ControlKind.CLOCK, chunk=frame.chunk,
                                       epoch=self.epoch,
                                       detail={"due_at": time.time() + deadline - time.monotonic()}))

    # --- helpers -------------------------------------------------------------------------------

    async def _wait_buffer_change(self) -> None:
        event = self._buffer_changed
        await event.wait()

    def _notify_buffer(self) -> None:
        self._buffer_changed.set()
        self._buffer_changed = asyncio.Event()

    def _set_depth(self) -> None:
        self.stats.depth = len(self._buffer)
        self.stats.max_depth_seen = max(self.stats.max_depth_seen, self.stats.depth)
        if self._metrics is not None:
            self._metrics.set_depth(self.stats.depth)

    async def teardown(self) -> None:
        self._end_turn(self._ctx)
        self.output.close()
        if self._metrics is not None:
            self._metrics.close(self.stats.achieved_fps if self.stats.frames_released else None)
            self._metrics = None


def _next_boundary(offset: int, left: int) -> int:
    """Frames from the next release to the start of the chunk after the one holding frame ``offset``
    (``left``: frames left in the chunk on screen)."""
    return left if offset < left else left + FRAMES_PER_CHUNK * ((offset - left) // FRAMES_PER_CHUNK + 1)


def _check_chunk(chunk: VideoChunk) -> str | None:
    frames, audio = chunk.frames, chunk.audio
    if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8 or frames.ndim != 4 \
            or frames.shape[0] != FRAMES_PER_CHUNK or frames.shape[3] != 3:
        return f"frames must be uint8 ({FRAMES_PER_CHUNK}, H, W, 3), got {getattr(frames, 'dtype', type(frames))} " \
               f"{getattr(frames, 'shape', '')}"
    if not isinstance(audio, np.ndarray) or audio.dtype != np.int16 or audio.shape != (SAMPLES_PER_CHUNK,):
        return f"audio must be int16 ({SAMPLES_PER_CHUNK},) at {TIMELINE_RATE} Hz, got " \
               f"{getattr(audio, 'dtype', type(audio))} {getattr(audio, 'shape', '')}"
    return None
