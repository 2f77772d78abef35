"""The ingest stage: agent events → ``AgentAudio`` (48 kHz timeline) + ``TurnEvent``; user audio → VAD
turns and barge-in.

It pulls events from the configured adapter (``stages.ingest.adapters``) and:

- **turns**: a turn id opens when the user starts speaking (VAD); the agent turn that follows answers
  it and carries the same id. Its trace holds ``user_speech_end`` (VAD, back-dated) and
  ``agent_first_audio`` (wall clock when the turn's first audio reached ingest).
- **audio**: validated (rate, format, NaN, clipping), resampled to 48 kHz int16 by a streaming
  polyphase filter, and emitted as the agent sends it. A turn's audio is contiguous on the media
  timeline: ``start_sample`` of its first frame is the media clock when it arrived (or the end of
  earlier speech). Audio more than ``max_ahead_s`` ahead of the media clock waits, so a burst from a
  faster-than-real-time TTS never floods the pipeline (and a barge-in has little to drop).
- **user audio** (the scripted user, or the client's microphone through ``feed_user_audio``):
  silero-vad at 16 kHz → USER_SPEECH_START / USER_SPEECH_END. User speech while the character speaks
  is a **barge-in**: the turn is marked interrupted (its remaining audio is dropped here),
  ``Control(INTERRUPT)`` goes to every stage (conditioning drops the turn's unplayed speech), a
  TurnEvent(INTERRUPT) follows, and the adapter is told to stop.
- **bad input** never ends the session: rejected frames, repaired samples, a turn end without a
  start, an agent that disconnects mid-turn are logged with the turn id and counted in ``stats``.

The media clock: sample ``(now - media_t0) · 48000``; ``media_t0`` is the constructor argument, else
the wall clock at setup. The stage's inputs are constructor arguments: its config section, the user's
microphone (``user_audio``, egress's queue; None: no microphone) and, for the frameworks that push
(``PushAdapter``), the adapter; otherwise ingest builds the configured adapter itself.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

import anyio
import numpy as np

from charstream.logs import LogLimit
from charstream.stages.base import Stage, StageContext
from charstream.stages.config import IngestConfig
from charstream.stages.ingest.adapters import (
    AgentAdapter,
    AgentAudioFrame,
    AgentDisconnected,
    AgentError,
    AgentEvent,
    AgentTurnEnd,
    AgentTurnStart,
    TurnRef,
    UserAudioFrame,
    UserSpeech,
    create_adapter,
)
from charstream.stages.ingest.audio_input import AudioFormatError, Repairs, to_float_mono
from charstream.stages.ingest.resample import StreamingResampler, to_int16
from charstream.stages.ingest.vad import UserAudioVAD, VadEvent
from charstream.timeline import CHARACTERS, TIMELINE_RATE, Timeline
from charstream.transport.messages import (
    AgentAudio,
    Control,
    ControlKind,
    InterruptPayload,
    Message,
    TraceContext,
    TurnEvent,
    TurnKind,
)

if TYPE_CHECKING:
    from charstream.stages.egress.mic import UserAudioQueue
    from charstream.stages.shared.tracing import TurnTracer

KEEP_TRACES = 16  # traces of recent user turns not yet answered (bounded)
CAPTURE_MAP_FRAMES = 256  # recent mic frames' (arrival, capture) times: ~5 s of 20 ms frames


@dataclass
class IngestStats:
    frames_in: int = 0  # agent audio frames received
    frames_rejected: int = 0  # refused (format) or dropped (interrupted turn)
    samples_emitted: int = 0  # 48 kHz samples sent downstream
    samples_repaired: int = 0  # NaN/inf silenced + out-of-range clipped
    turns: int = 0  # agent turns started
    interrupts: int = 0  # barge-ins
    protocol_errors: int = 0  # turn end without start, disconnect mid-turn, ...
    vad_events: list[tuple[str, float, float]] = field(default_factory=list)  # (kind, at, detected_at)


@dataclass
class _AgentTurn:
    turn_id: int
    ref: TurnRef
    trace: TraceContext
    next_sample: int | None = None  # timeline position of the next sample; set by the first audio
    rate: int | None = None
    resampler: StreamingResampler | None = None
    interrupted: bool = False
    repairs: Repairs = field(default_factory=Repairs)


class IngestStage(Stage):
    name = "ingest"

    def __init__(self, config: IngestConfig, adapter: AgentAdapter | None = None,
                 media_t0: float | None = None, user_audio: UserAudioQueue | None = None,
                 tracer: TurnTracer | None = None, timeline: Timeline = CHARACTERS) -> None:
        self.config = config
        self.timeline = timeline  # the session's: a barge-in drops from its next chunk boundary
        # how far ahead of the media clock agent audio goes out: max_ahead_s, or a chunk where chunks are
        # longer -- a faster-than-real-time agent then fills a whole chunk (FlashHead's is 1.12 s) without
        # waiting for the clock, and conditioning can build it as soon as it is said
        self.ahead_s = max(config.max_ahead_s, timeline.chunk_seconds)
        self.adapter = adapter
        self.user_audio = user_audio  # egress's microphone queue; None: this session has no microphone
        self.tracer = tracer  # the session's: what the agent heard and answered goes with each turn
        self.media_t0 = media_t0
        self.stats = IngestStats()
        self._log_limit = LogLimit()  # an agent repeating a protocol error logs a few lines and a count
        self._ctx: StageContext | None = None
        self._vad: UserAudioVAD | None = None
        self._seq = 0
        self._next_turn_id = 0
        self._user_turn: int | None = None  # opened by user speech, not yet answered by the agent
        self._user_speaking = False
        self._traces: OrderedDict[int, TraceContext] = OrderedDict()
        self._turn: _AgentTurn | None = None  # the agent turn being ingested
        self._last_turn: _AgentTurn | None = None
        self._speech_until = 0  # timeline sample where emitted agent speech ends
        self._wake = anyio.Event()  # set on barge-in: a pacing wait ends early
        # (first sample's index in the mic stream, samples, its arrival time, its capture time or None)
        self._capture_map: deque[tuple[int, int, float, float | None]] = deque(maxlen=CAPTURE_MAP_FRAMES)
        self._mic_samples = 0  # samples of user audio fed so far

    # --- lifecycle -----------------------------------------------------------------------------

    async def setup(self, ctx: StageContext) -> None:
        self._ctx = ctx
        if self.media_t0 is None:
            self.media_t0 = time.time()
        if self.adapter is None:
            # an agent that paces itself by ingest's horizon (the scripted one, "synthesized") gets this one's
            self.adapter = create_adapter(replace(self.config, max_ahead_s=self.ahead_s), ctx.session_id)
        self._vad = await anyio.to_thread.run_sync(
            lambda: UserAudioVAD(self.config.vad_threshold, self.config.vad_silence_ms, self.config.vad_start_ms)
        )
        await self.adapter.start()

    async def run(self, ctx: StageContext) -> None:
        """Ingest the agent's events and, if there is one, the user's microphone; returns when both end."""
        async with anyio.create_task_group() as tg:
            if self.user_audio is not None:  # not truthiness: an empty queue is falsy
                tg.start_soon(self.listen, self.user_audio)
            async for event in self.adapter.events():
                await self._on_agent_event(event)
            if self._turn is not None:
                self._protocol_error("agent events ended mid-turn: turn ended", self._turn.turn_id)
                await self._end_turn("ended")
            ctx.log.info("agent_finished", turns=self.stats.turns, interrupts=self.stats.interrupts)

    async def listen(self, user_audio: UserAudioQueue) -> None:
        """VAD on egress's microphone queue (``get()`` -> frames with ``samples``, 48 kHz int16, and
        ``received_at``, the wall clock of arrival) until the queue closes."""
        from charstream.stages.egress.mic import UserAudioClosed  # aiortc: imported only when a mic is wired

        while True:
            try:
                frame = await user_audio.get()
            except UserAudioClosed:
                return
            # on the arrival clock, the frame's first sample came one frame duration before the frame;
            # its capture time (the browser's clock, mapped) dates the user's real end of speech
            await self.feed_user_audio(frame.samples, frame.received_at - len(frame.samples) / TIMELINE_RATE,
                                       captured_at=frame.captured_at)

    async def teardown(self) -> None:
        if self.adapter is not None:
            await self.adapter.close()

    async def process(self, msg: Message, ctx: StageContext) -> None:
        self._protocol_error(f"ingest has no data input; got {type(msg).__name__}", None)

    # --- clock ---------------------------------------------------------------------------------

    def media_now(self) -> int:
        """The media clock, in timeline samples."""
        return int((time.time() - self.media_t0) * TIMELINE_RATE)

    @property
    def character_speaking(self) -> bool:
        """The agent's turn is open, or its speech may still be playing: ingest runs ahead of playout
        by the pipeline's latency, which ``playout_tail_s`` covers."""
        turn = self._turn
        tail = int(self.config.playout_tail_s * TIMELINE_RATE)
        return (turn is not None and not turn.interrupted) or self._speech_until + tail > self.media_now()

    # --- user audio → VAD ----------------------------------------------------------------------

    async def feed_user_audio(self, samples: np.ndarray, at_wall_time: float, sample_rate: int = 48_000,
                              captured_at: float | None = None) -> None:
        """The user's microphone audio (mono int16/float32, 48 kHz from WebRTC), first sample at
        ``at_wall_time`` (arrival clock) and, if known, ``captured_at`` (when the user spoke it).
        The adapter hears it first; detected speech start/end become TurnEvents; speech over the
        character is a barge-in."""
        if sample_rate != self._vad.sample_rate:
            self._protocol_error(f"user audio at {sample_rate} Hz; the VAD takes {self._vad.sample_rate} Hz", None)
            return
        self._capture_map.append((self._mic_samples, len(samples), at_wall_time, captured_at))
        self._mic_samples += len(samples)
        await self.adapter.hear(UserAudioFrame(samples, sample_rate, at_wall_time))
        try:
            events = self._vad.feed(samples, at_wall_time)
        except AudioFormatError as e:
            self._protocol_error(f"user audio refused: {e}", self._user_turn)
            return
        for event in events:
            await self._on_vad(event)

    async def _on_vad(self, event: VadEvent, barge_in: bool | None = None) -> None:
        """``barge_in``: the framework that owns turn-taking decided (None: ours, by whether the
        character is speaking)."""
        ctx = self._ctx
        self.stats.vad_events.append((event.kind.value, event.at, event.detected_at))
        del self.stats.vad_events[:-64]
        if event.kind == TurnKind.USER_SPEECH_START:
            turn = self._turn or self._last_turn
            if turn is not None and not turn.interrupted and (
                    self.character_speaking if barge_in is None else barge_in):
                await self._barge_in(turn, event)
            if self._user_speaking:  # a second signal for the same utterance (a framework sends two)
                return
            self._user_speaking = True
            self._next_turn_id += 1
            self._user_turn = self._next_turn_id
            self._traces[self._user_turn] = TraceContext(self._user_turn)
            while len(self._traces) > KEEP_TRACES:
                self._traces.popitem(last=False)
            ctx.log.info("user_speech_start", turn_id=self._user_turn, at=event.at)
            message = TurnEvent(ctx.session_id, self._next_seq(), TurnKind.USER_SPEECH_START, self._user_turn,
                                event.at, TraceContext(self._user_turn))
        else:
            self._user_speaking = False
            if self._user_turn is None:  # VAD ends only what it started; defensive
                return
            trace = self._traces.get(self._user_turn) or TraceContext(self._user_turn)
            spoken = self._captured(event)
            trace.stamp("user_speech_end", spoken)
            trace.stamp("vad_speech_end", event.at)  # the same end dated on the arrival clock
            trace.stamp("vad_decided")
            ctx.log.info("user_speech_end", turn_id=self._user_turn, at=spoken, vad_at=event.at,
                         detected_after_s=round(event.detected_at - event.at, 3))
            message = TurnEvent(ctx.session_id, self._next_seq(), TurnKind.USER_SPEECH_END, self._user_turn,
                                spoken, _copy(trace))
        await ctx.emit(message)
        await self.adapter.notify(message)

    async def _barge_in(self, turn: _AgentTurn, event: VadEvent) -> None:
        ctx, turn_id = self._ctx, turn.turn_id
        now = self.media_now()
        drop_from = -(-now // self.timeline.samples_per_chunk)  # first chunk boundary at or after now
        turn.interrupted = True
        self._speech_until = min(self._speech_until, now - int(self.config.playout_tail_s * TIMELINE_RATE))
        self._wake.set()
        self.stats.interrupts += 1
        ctx.log.info("barge_in", turn_id=turn_id, user_speech_at=event.at, drop_from_chunk=drop_from)
        await ctx.send_control(Control(ctx.session_id, self._next_seq(), ControlKind.INTERRUPT, chunk=drop_from,
                                       payload=InterruptPayload(at_sample=now), trace=TraceContext(turn_id)))
        await ctx.emit(TurnEvent(ctx.session_id, self._next_seq(), TurnKind.INTERRUPT, turn_id, time.time(),
                                 TraceContext(turn_id)))
        await self.adapter.interrupt(turn.ref)

    def _captured(self, event: VadEvent) -> float:
        """When the user spoke ``event``'s sample of the mic stream, from the capture time of the
        frame that holds it (by position, not by the arrival clock, which bunches frames up on a
        busy machine); ``event.at`` where the capture time is not known."""
        if event.sample is None:
            return event.at
        for start, count, _, captured in reversed(self._capture_map):
            if start <= event.sample:
                if captured is None or event.sample > start + count:  # not known, or older than the map
                    return event.at
                return captured + (event.sample - start) / self._vad.sample_rate
        return event.at

    # --- agent events --------------------------------------------------------------------------

    async def _on_agent_event(self, event: AgentEvent) -> None:
        if isinstance(event, AgentAudioFrame):
            await self._on_audio(event)
        elif isinstance(event, UserAudioFrame):
            await self.feed_user_audio(event.samples, event.at, event.sample_rate)
        elif isinstance(event, UserSpeech):
            await self._on_vad(VadEvent(event.kind, event.at, time.time(), 1.0), barge_in=event.interrupt)
        elif isinstance(event, AgentTurnStart):
            await self._start_turn(event.turn_ref)
            if event.heard is not None or event.answer is not None:
                self._ctx.log.info("agent_turn_text", turn_id=self._turn.turn_id, heard=event.heard,
                                   answer=event.answer)
                if self.tracer is not None:
                    self.tracer.annotate(self._turn.turn_id, heard=event.heard, answer=event.answer)
        elif isinstance(event, AgentTurnEnd):
            if self._turn is None:
                last = self._last_turn.turn_id if self._last_turn else None
                self._protocol_error("agent turn end without a start: ignored", last, turn_ref=event.turn_ref)
            else:
                await self._end_turn(event.reason)
        elif isinstance(event, AgentError):
            self._protocol_error(event.problem, self._turn.turn_id if self._turn else None, turn_ref=event.turn_ref)
        elif isinstance(event, AgentDisconnected):
            turn_id = self._turn.turn_id if self._turn else None
            if self._turn is not None:
                self._protocol_error(f"agent disconnected mid-turn ({event.detail}): turn ended", turn_id)
                await self._end_turn("disconnected")
            else:
                self._ctx.log.warning("agent_disconnected", detail=event.detail, turn_id=turn_id)
        else:
            self._protocol_error(f"unknown agent event {type(event).__name__}", None)

    async def _start_turn(self, turn_ref: TurnRef) -> None:
        ctx = self._ctx
        if self._turn is not None:
            self._protocol_error("agent turn start while a turn is open: the open turn is ended", self._turn.turn_id)
            await self._end_turn("superseded")
        if self._user_turn is not None:  # the answer to the user's last utterance
            turn_id, self._user_turn = self._user_turn, None
        else:  # the agent speaks first (a greeting): a turn without user speech
            self._next_turn_id += 1
            turn_id = self._next_turn_id
        trace = self._traces.pop(turn_id, None) or TraceContext(turn_id)
        self._turn = _AgentTurn(turn_id, turn_ref, trace)
        self.stats.turns += 1
        ctx.log.info("agent_turn_start", turn_id=turn_id, turn_ref=turn_ref)
        await ctx.emit(TurnEvent(ctx.session_id, self._next_seq(), TurnKind.AGENT_TURN_START, turn_id, time.time(),
                                 _copy(trace)))

    async def _end_turn(self, reason: str) -> None:
        ctx, turn = self._ctx, self._turn
        if turn.resampler is not None and not turn.interrupted:
            await self._emit_audio(turn, to_int16(turn.resampler.flush()))
        if turn.repairs:
            ctx.log.warning("agent_audio_repaired", turn_id=turn.turn_id, non_finite=turn.repairs.non_finite,
                            clipped=turn.repairs.clipped)
        self._last_turn, self._turn = turn, None
        reason = "interrupted" if turn.interrupted else reason
        ctx.log.info("agent_turn_end", turn_id=turn.turn_id, reason=reason)
        await ctx.emit(TurnEvent(ctx.session_id, self._next_seq(), TurnKind.AGENT_TURN_END, turn.turn_id, time.time(),
                                 _copy(turn.trace)))

    async def _on_audio(self, frame: AgentAudioFrame) -> None:
        self.stats.frames_in += 1
        if self._turn is None:
            self._ctx.log.warning("agent audio without a turn start: turn started", turn_ref=frame.turn_ref)
            self.stats.protocol_errors += 1
            await self._start_turn(frame.turn_ref)
        turn = self._turn
        if turn.interrupted:
            self.stats.frames_rejected += 1
            return
        try:
            audio, repairs = to_float_mono(frame.samples, frame.sample_rate, frame.channels)
        except AudioFormatError as e:
            self.stats.frames_rejected += 1
            self._ctx.log.error("agent_audio_rejected", turn_id=turn.turn_id, problem=str(e))
            return
        if repairs:
            if not turn.repairs:  # warn at once, summarise at the turn's end
                self._ctx.log.warning("agent_audio_bad_samples", turn_id=turn.turn_id,
                                      non_finite=repairs.non_finite, clipped=repairs.clipped)
            turn.repairs.non_finite += repairs.non_finite
            turn.repairs.clipped += repairs.clipped
            self.stats.samples_repaired += repairs.non_finite + repairs.clipped
        if turn.rate != frame.sample_rate:
            if turn.resampler is not None:  # the agent changed rate mid-turn: finish the old stream
                self._ctx.log.warning("agent_rate_changed", turn_id=turn.turn_id, old=turn.rate, new=frame.sample_rate)
                await self._emit_audio(turn, to_int16(turn.resampler.flush()))
            turn.rate = frame.sample_rate
            turn.resampler = StreamingResampler(frame.sample_rate, TIMELINE_RATE)
        if "agent_first_audio" not in turn.trace.stamps:
            turn.trace.stamp("agent_first_audio")
        await self._emit_audio(turn, to_int16(turn.resampler.push(audio)))

    async def _emit_audio(self, turn: _AgentTurn, samples: np.ndarray) -> None:
        if not len(samples):
            return
        ctx = self._ctx
        if turn.next_sample is None:
            turn.next_sample = max(self.media_now(), self._speech_until)
        # pace: wait while this audio would start more than ahead_s ahead of the media clock
        ahead = (turn.next_sample - self.media_now()) / TIMELINE_RATE - self.ahead_s
        if ahead > 0:
            self._wake = anyio.Event()
            with anyio.move_on_after(ahead):
                await self._wake.wait()
        if turn.interrupted:
            self.stats.frames_rejected += 1
            return
        start, turn.next_sample = turn.next_sample, turn.next_sample + len(samples)
        self._speech_until = max(self._speech_until, turn.next_sample)
        self.stats.samples_emitted += len(samples)
        await ctx.emit(AgentAudio(ctx.session_id, self._next_seq(), samples, start, TIMELINE_RATE, _copy(turn.trace)))

    # --- helpers -------------------------------------------------------------------------------

    def _next_seq(self) -> int:
        self._seq += 1
        return self._seq

    def _protocol_error(self, problem: str, turn_id: int | None, **extra: Any) -> None:
        self.stats.protocol_errors += 1
        self._log_limit(self._ctx.log.error, "agent_protocol_error", turn_id=turn_id, problem=problem, **extra)


def _copy(trace: TraceContext) -> TraceContext:
    """Messages may be shared in-process: each gets its own snapshot of the turn's stamps."""
    return TraceContext(trace.turn_id, dict(trace.stamps))
