"""Playout: the session's jitter buffer and its 24 fps clock, wired.

Chunks (4 frames + their 8,000 audio samples) arrive from decode into the clock's bounded buffer
(clock.py). Once ``target_depth_chunks`` chunks wait behind the first one, the clock starts: frame
``n`` of the output timeline is released at ``t0 + n / 24`` (absolute deadlines on the monotonic
clock, so sleep error never accumulates), together with exactly its 2,000 samples, into the
``PlayoutOutput`` egress reads (output.py). The buffer therefore holds ``target_depth_chunks ×
166.7 ms`` of media ahead of the playhead: an upstream stall shorter than that is absorbed; a longer
one is an underrun, counted by cause (stats.py).

Backpressure: ``process`` waits while the buffer holds ``max_depth_chunks`` (upstream gets no
credit meanwhile). A rollback wakes that wait (the waiting chunk is then stale), so a runner should
deliver ``control`` while ``process`` waits; a dispatch loop that awaits ``process`` before taking
control delays a turn start by up to one chunk (166.7 ms) whenever the buffer is full.

Turn starts run the rollback (docs/ARCHITECTURE.md, Turn-start rollback): the speech is placed by
onset.py from speech_estimate.py's estimate, and its chunks are measured against that schedule.
Whenever the clock (re)starts playing after waiting for chunks, playout sends ``Control(CLOCK)``:
conditioning paces listening chunks from it.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import numpy as np

from charstream.stages.base import Stage, StageContext
from charstream.stages.config import PlayoutConfig
from charstream.stages.playout.clock import ClockState, PlayoutClock
from charstream.stages.playout.onset import Onset, Playhead, place_speech
from charstream.stages.playout.output import PlayoutOutput, ReleasedFrame
from charstream.stages.playout.speech_estimate import SpeechEstimator
from charstream.stages.playout.stats import PlayoutStats, UnderrunCause
from charstream.stages.playout.yuv import FORMAT, Yuv420Converter
from charstream.stages.shared.metrics import SessionMetrics
from charstream.stages.shared.tracing import TurnTracer
from charstream.timeline import CHARACTERS, TIMELINE_RATE, Timeline
from charstream.transport.messages import (
    ClockPayload,
    Control,
    ControlKind,
    Message,
    RollbackPayload,
    TurnStartPayload,
    VideoChunk,
)


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
    """Consumes ``VideoChunk``; releases frames + audio on the session's clock (its timeline's fps) into
    ``output``, whose timeline is the session's."""

    name = "playout"
    control_during_process = True  # a turn start must not wait behind a chunk waiting for room

    def __init__(self, config: PlayoutConfig, output: PlayoutOutput | None = None,
                 tracer: TurnTracer | None = None, timeline: Timeline = CHARACTERS, rephase: bool = False) -> None:
        self.config = config
        # a chunk-motion model: a turn start re-phases the chunk grid at the speech's onset (onset.py, clock.py)
        self.rephase = rephase
        # What egress reads; the session hands in the one it serves (None: a fresh one of our own).
        self.output = output if output is not None else PlayoutOutput(config.history_frames, timeline=timeline)
        if self.output.timeline != timeline:
            raise ValueError(f"playout runs on {timeline}, its output on {self.output.timeline}")
        self.timeline = timeline
        self.frame_seconds = timeline.frame_seconds
        self.tracer = tracer
        self.stats = PlayoutStats()
        self.clock = PlayoutClock(config.target_depth_chunks, timeline, rephase)
        self._control_seq = 0
        # The parts of recent chunks' production, and what turn starts took beyond their estimate.
        allowance = config.initial_allowance_s
        self._estimator = SpeechEstimator(initial_allowance_s=timeline.chunk_seconds if allowance is None else allowance,
                                          waits_for_decode=rephase)
        self._plan: _SpeechPlan | None = None
        self._speech_due: float | None = None  # monotonic deadline of the placed speech chunk's first frame
        self._metrics: SessionMetrics | None = None
        self._ctx: StageContext | None = None
        self._yuv = Yuv420Converter()
        self._converting = asyncio.Lock()  # one conversion at a time: the converter keeps one scaler
        self._conversions: set[asyncio.Task] = set()

    @property
    def epoch(self) -> int:
        return self.clock.epoch

    @property
    def last_committed(self) -> int | None:
        return self.clock.last_committed

    async def setup(self, ctx: StageContext) -> None:
        # the config refused a depth beyond the buffer (PlayoutConfig.check_together)
        self._ctx = ctx
        self._metrics = SessionMetrics(ctx.session_id)

    # --- input ---------------------------------------------------------------------------------

    async def process(self, msg: Message, ctx: StageContext) -> None:
        if not isinstance(msg, VideoChunk):
            ctx.log.error("playout_unexpected_message", type=type(msg).__name__)
            return
        problem = _check_chunk(msg, self.timeline)
        if problem:
            self.stats.invalid_chunks += 1
            ctx.log.error("playout_invalid_chunk", chunk=msg.chunk, problem=problem)
            return
        if msg.offset:  # a later part: its chunk is in the buffer or on screen already
            self._estimator.decoded(msg.trace.stamps)
            chunk = self.clock.extend(msg)
            if chunk is None:
                ctx.log.debug("playout_part_without_chunk", chunk=msg.chunk, epoch=msg.epoch, offset=msg.offset)
            elif self.output.video_format == FORMAT and Yuv420Converter.fits(msg.frames):
                self._start_conversion(chunk, msg.frames, msg.offset)
            return
        self._measure(msg, ctx)
        clock = self.clock
        # Waiting for room is the backpressure: while we wait, upstream gets no credit.
        while len(clock.buffer) >= self.config.max_depth_chunks:
            await clock.wait_changed()
        if msg.epoch < clock.epoch:  # checked after the wait: a rollback may have happened meanwhile
            self.stats.stale_chunks += 1
            return
        if msg.epoch > clock.epoch:
            ctx.log.warning("playout_epoch_ahead", chunk=msg.chunk, epoch=msg.epoch, playout_epoch=clock.epoch)
            clock.epoch = msg.epoch
        self._follow_speech(msg, ctx)
        if clock.state is ClockState.WAITING and self.output.t0 is not None:
            self.stats.late_chunks += 1
        clock.push(msg)
        self._set_depth()
        if self.output.video_format == FORMAT and Yuv420Converter.fits(msg.frames):
            self._start_conversion(msg, msg.frames, 0)

    def _start_conversion(self, chunk: VideoChunk, frames: np.ndarray, offset: int) -> None:
        task = asyncio.create_task(self._convert(chunk, frames, offset))
        self._conversions.add(task)
        task.add_done_callback(self._conversions.discard)

    async def _convert(self, chunk: VideoChunk, frames: np.ndarray, offset: int) -> None:
        """The chunk's frames from ``offset`` in the video reader's format, on a worker thread; its frames
        released before they are ready go without (the reader converts those itself)."""
        async with self._converting:
            try:
                video = await asyncio.to_thread(self._yuv.convert, frames)
            except Exception as e:  # noqa: BLE001 -- the reader converts the frames itself
                if self._ctx is not None:
                    self._ctx.log.warning("playout_conversion_failed", chunk=chunk.chunk, error=repr(e))
                return
        self.clock.add_video(chunk, video, offset)

    async def control(self, msg: Control, ctx: StageContext) -> None:
        if msg.kind in (ControlKind.TURN_START, ControlKind.INTERRUPT):
            self._end_turn(ctx)  # the speech before is over: its errors count before the next estimate
        if msg.kind == ControlKind.TURN_START:
            payload = msg.payload if isinstance(msg.payload, TurnStartPayload) else None
            await self.rollback(ctx, ControlKind.TURN_START, self._place_speech(payload))
        elif msg.kind == ControlKind.INTERRUPT:
            await self.rollback(ctx, ControlKind.INTERRUPT)

    def _measure(self, chunk: VideoChunk, ctx: StageContext) -> None:
        """Record the parts of the chunk's production (its stamps, and its arrival now)."""
        parts = self._estimator.observe(chunk.trace.stamps, time.time())
        if parts is not None:
            ctx.log.debug("playout_chunk_measured", chunk=chunk.chunk, epoch=chunk.epoch,
                          step_ms=round(parts[0] * 1e3, 1), delivery_ms=round(parts[1] * 1e3, 1))

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
        error = now - (plan.expected_at + (k * self.timeline.chunk_seconds - plan.onset * self.frame_seconds if k else 0.0))
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

    def _place_speech(self, turn_start: TurnStartPayload | None) -> Onset | None:
        """Where the turn's speech starts (None: no estimate -- no clock, starved, nothing measured yet, or
        a turn start with nothing to place by -- so every unplayed chunk goes and the speech plays when it comes;
        re-phased, also while an earlier placement's onset inside a chunk is still to come: the frames ahead
        are not whole chunks then)."""
        clock, t0 = self.clock, self.output.t0
        if t0 is None or clock.state is ClockState.WAITING or not self._estimator.measured or turn_start is None:
            return None
        if self.rephase and clock.onset_ahead():
            return None
        estimate = self._estimator.estimate(time.time(), turn_start.encode_s, turn_start.last_emit_at)
        playing = clock.playing
        playhead = Playhead(t0, self.output.next_index, None if playing is None else playing.chunk, clock.position,
                            playing.chunk + 1 if playing is not None else clock.buffer[0].chunk, len(clock.buffer),
                            self.timeline)
        return place_speech(estimate, turn_start, playhead, time.monotonic(), self.rephase)

    async def rollback(self, ctx: StageContext, reason: ControlKind = ControlKind.TURN_START,
                       place: Onset | None = None) -> Control:
        """Keep the unplayed chunks before ``place`` and drop the rest (clock.py), then tell upstream where
        to regenerate from: the chunk after the last one kept whole. No ``place``: every unplayed chunk goes."""
        clock = self.clock
        start_frame = self._restart_frame(place) if self.rephase else None
        kept, dropped, last = clock.rollback(place, turn_start=reason == ControlKind.TURN_START)
        self.stats.rollbacks += 1
        self.stats.rolled_back_chunks += len(dropped)
        self.stats.kept_chunks += len(kept)
        self._set_depth()
        self._control_seq += 1
        if place is None:
            self._speech_due, self._plan = None, None
            payload = RollbackPayload(reason, 0, len(dropped), len(kept), start_frame=start_frame)
        else:
            # Deadlines of the regenerated chunk's first frame (conditioning's anchor) and of the onset frame;
            # re-phased, that chunk starts at the onset, and the speech's later chunks a whole chunk apart.
            left = clock.frames_left_on_screen()
            start = self.output.next_index + (
                -clock.position if place.chunk == clock.chunk_on_screen() else left + self.timeline.frames_per_chunk * place.kept)
            shift = place.onset if self.rephase else 0
            self._speech_due = self.output.t0 + (start + place.onset) / self.timeline.fps
            placed_at = time.time()
            self._plan = _SpeechPlan(clock.epoch, place.chunk, place.onset - shift,
                                     time.monotonic() + place.estimate.expected_s, placed_at)
            payload = RollbackPayload(reason, place.onset, len(dropped), len(kept), placed_at,
                                      due_at=placed_at + self.output.t0 + (start + shift) / self.timeline.fps - time.monotonic(),
                                      start_frame=start_frame)
        rollback = Control(ctx.session_id, self._control_seq, ControlKind.ROLLBACK, chunk=last, epoch=clock.epoch,
                           payload=payload)
        ctx.log.info("playout_rollback", last_kept=last, epoch=clock.epoch, kept=[c.chunk for c in kept],
                     dropped=[c.chunk for c in dropped], onset_frame=payload.onset_frame, reason=str(reason),
                     due_in_ms=None if self._speech_due is None else round((self._speech_due - time.monotonic()) * 1e3, 1),
                     **({} if place is None else place.estimate.fields()))
        await ctx.send_control(rollback)
        return rollback

    def _restart_frame(self, place: Onset | None) -> int | None:
        """The media frame a re-phased rollback restarts the chunk grid at, from the chunks' own first frames:
        ``place``'s onset frame in the chunk on screen or a buffered one (not made yet: a whole chunk after the
        last one here); no ``place``: the end of the chunk playing. None: nothing here to count from (the
        grid stays as it is)."""
        n, clock = self.timeline.frames_per_chunk, self.clock
        if place is None:
            return None if clock.playing is None else _first_frame(clock.playing, n) + n
        holder = clock.playing if place.chunk == clock.chunk_on_screen() else next(
            (c for c in clock.buffer if c.chunk == place.chunk), None)
        if holder is not None:
            return _first_frame(holder, n) + place.onset
        last = clock.buffer[-1] if clock.buffer else clock.playing
        return None if last is None else _first_frame(last, n) + n * (place.chunk - last.chunk)

    # --- the clock -----------------------------------------------------------------------------

    async def run(self, ctx: StageContext) -> None:
        clock = self.clock
        while len(clock.buffer) < clock.resume_depth:
            await clock.wait_changed()
        t0 = time.monotonic()  # the tracks pace audio packets on this same clock
        self.output.start(t0)
        index = 0
        try:
            while True:
                deadline = t0 + index * self.frame_seconds
                delay = deadline - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                elif -delay > self.frame_seconds:
                    self.stats.late_ticks += 1
                tick = clock.next_frame(index, time.time())
                if len(clock.buffer) != self.stats.depth:  # a chunk went on screen
                    self._set_depth()
                if tick.underrun is not None:
                    self._underrun(index, tick.underrun)
                if tick.held is not None:
                    self.stats.count_held(tick.held)
                else:
                    self.stats.fresh_frames += 1
                frame = tick.frame
                self.output.publish(frame)
                if tick.resumed:  # conditioning paces listening chunks from this
                    await self._send_clock(ctx, frame, deadline)
                self.stats.frames_released += 1
                self.stats.elapsed_s = time.monotonic() - t0 + self.frame_seconds
                if frame.first_speaking and self.tracer is not None and frame.trace is not None:
                    self.tracer.merge(frame.trace)
                if index % self.timeline.fps == 0 and self._metrics is not None:
                    self._metrics.set_fps(self.stats.achieved_fps)
                index += 1
        finally:
            self.output.close()

    def _underrun(self, index: int, cause: UnderrunCause) -> None:
        self.stats.count_underrun(cause)
        if self._metrics is not None:
            self._metrics.underrun()
        if self._ctx is not None:
            self._ctx.log.warning("playout_underrun", frame=index, cause=str(cause), underruns=self.stats.underruns)

    async def _send_clock(self, ctx: StageContext, frame: ReleasedFrame, deadline: float) -> None:
        """Tell conditioning when the chunk that just started playing was due (its pacing anchor)."""
        if frame.chunk is None or frame.frame_in_chunk != 0:
            return
        self._control_seq += 1
        await ctx.send_control(Control(ctx.session_id, self._control_seq, ControlKind.CLOCK, chunk=frame.chunk,
                                       epoch=self.clock.epoch,
                                       payload=ClockPayload(time.time() + deadline - time.monotonic())))

    # --- helpers -------------------------------------------------------------------------------

    def _set_depth(self) -> None:
        self.stats.depth = len(self.clock.buffer)
        self.stats.max_depth_seen = max(self.stats.max_depth_seen, self.stats.depth)
        if self._metrics is not None:
            self._metrics.set_depth(self.stats.depth)

    async def teardown(self) -> None:
        for task in list(self._conversions):
            task.cancel()
        self._end_turn(self._ctx)
        self.output.close()
        if self._metrics is not None:
            self._metrics.close(self.stats.achieved_fps if self.stats.frames_released else None)
            self._metrics = None


def _first_frame(chunk: VideoChunk, frames_per_chunk: int) -> int:
    """The chunk's first frame on the media timeline (the unshifted grid's where it does not say)."""
    return chunk.chunk * frames_per_chunk if chunk.start_frame is None else chunk.start_frame


def _check_chunk(chunk: VideoChunk, timeline: Timeline) -> str | None:
    """What is wrong with a chunk or a part of one (None: nothing)."""
    frames, audio, n = chunk.frames, chunk.audio, timeline.frames_per_chunk
    offset = chunk.offset if isinstance(chunk.offset, int) else -1
    if not 0 <= offset < n:
        return f"offset must be a frame of the chunk, 0 to {n - 1}, got {chunk.offset}"
    if not isinstance(frames, np.ndarray) or frames.dtype != np.uint8 or frames.ndim != 4 \
            or not 0 < frames.shape[0] <= n - offset or frames.shape[3] != 3:
        return f"frames must be uint8 (1 to {n - offset}, H, W, 3) from frame {offset}, got " \
               f"{getattr(frames, 'dtype', type(frames))} {getattr(frames, 'shape', '')}"
    span = 0 if offset else timeline.samples_per_chunk  # the first part carries the chunk's audio
    if not isinstance(audio, np.ndarray) or audio.dtype != np.int16 or audio.shape != (span,):
        return f"audio must be int16 ({span},) at {TIMELINE_RATE} Hz in a part from frame {offset}, got " \
               f"{getattr(audio, 'dtype', type(audio))} {getattr(audio, 'shape', '')}"
    return None
