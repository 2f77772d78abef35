"""Conditioning: agent speech on the 48 kHz media timeline → one ``Conditioning`` per chunk, forever.

The stream never stops: with no speech to place, every chunk is a listening chunk (silence,
``speaking=False``) and the loop runs as fast as downstream credit allows. A turn's speech is placed
by the turn-start rollback: docs/ARCHITECTURE.md, Turn-start rollback. This stage's part in it: it
paces listening chunks (at most ``min(idle_lead_chunks, rollback_frames)`` ahead of playout, from
playout's ``Control(CLOCK)`` and each ROLLBACK's ``due_at``; just in time once a turn's audio
starts), sends ``Control(TURN_START)`` from ``process`` (the dispatch loop, never behind the chunk
loop's wait for credit) once the first chunk's audio and look-ahead are in, and on the ROLLBACK places
the speech at frame ``onset_frame`` of the chunk after the last kept one (its leading frames silent)
and emits from there in the new epoch; a ROLLBACK with a ``start_frame`` (a chunk-motion model) re-phases
the chunk grid instead: that chunk, and the speech, start at that media frame. With no answer within ``rollback_wait_s`` it places the speech
at the next chunk anyway.

A speaking chunk is emitted once its whole span plus the look-ahead has arrived, or the turn has
ended. The turn's first speaking chunk carries the turn's trace stamps; every chunk carries
``conditioning_ready`` (playout measures the production latency from it).
``start_sample`` of ``AgentAudio`` is used relative to the turn's first audio, so adapters may
count from the turn or from the session.

Bad input (wrong rate or dtype, audio without a turn, a turn end without a start, an agent that
stops sending mid-turn) is logged with the turn id and dropped or ended; listening continues.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import anyio
import numpy as np

from charstream.stages.base import Stage, StageContext
from charstream.stages.config import ConditioningConfig
from charstream.stages.shared.worker import StageWorker
from charstream.timeline import CHARACTERS, TIMELINE_RATE, Timeline, ms_samples
from charstream.transport.messages import (
    AgentAudio,
    ClockPayload,
    Conditioning,
    Control,
    ControlKind,
    Message,
    RollbackPayload,
    TraceContext,
    TurnEvent,
    TurnKind,
    TurnStartPayload,
)

if TYPE_CHECKING:
    from charstream.model.families.base import ModelFamily
    from charstream.stages.conditioning.batcher import EncodeBatcher

# int16 48 kHz window [chunk start - context, chunk end + look-ahead) -> (n_audio_tokens, audio_dim) float32
EncodeFn = Callable[[np.ndarray], np.ndarray]

MAX_GAP_SAMPLES = 5 * TIMELINE_RATE  # an agent jumping ahead further than this is a protocol error
KEEP_TURN_STAMPS = 16  # stamps of turns whose speech has not arrived yet (bounded)
# While a turn's first chunk is awaited, listening chunks go this many chunks ahead of their due time:
# playout's buffer covers the wait, and the step is idle (not busy with a chunk the speech replaces)
# when the speech comes; one chunk still covers a step + decode if the agent is slow to send it.
PENDING_LEAD_CHUNKS = 1
# Recent turns' first encodes: the estimate a turn start sends is their max. A turn's first encode runs
# while the step idles (PENDING_LEAD_CHUNKS); the encodes inside a turn run beside the chunk before's
# decode and its frames' arrival, and on an H100 took 72-81 ms against 8-28 (FlashHead Pro): counted,
# they delayed every placement by the difference.
ENCODE_HISTORY = 8
ENCODE_THREADS = 1  # a chunk's encode is small ops that more intra-op threads do not speed up


@dataclass
class _Turn:
    turn_id: int
    first_start_sample: int  # the adapter's start_sample of the turn's first audio
    trace: TraceContext
    buffer: np.ndarray = field(default_factory=lambda: np.zeros(TIMELINE_RATE, np.int16))  # grows by doubling
    length: int = 0  # samples held, from the turn's first sample (buffer grows by doubling)
    placed_at: int | None = None  # timeline sample of the turn's first sample, once placed
    ended: bool = False
    turn_start_sent_at: float | None = None
    last_audio_at: float = 0.0

    @property
    def audio(self) -> np.ndarray:
        return self.buffer[:self.length]

    def append(self, offset: int, samples: np.ndarray) -> None:
        """Write ``samples`` at ``offset`` (>= length); a gap before it stays silent."""
        end = offset + len(samples)
        if end > len(self.buffer):
            grown = np.zeros(max(end, 2 * len(self.buffer)), np.int16)
            grown[:self.length] = self.audio
            self.buffer = grown
        self.buffer[self.length:offset] = 0
        self.buffer[offset:end] = samples
        self.length = max(self.length, end)


class ConditioningStage(Stage):
    name = "conditioning"

    def __init__(self, config: ConditioningConfig, encode: EncodeFn, lookahead_ms: float, context_ms: float = 0.0,
                 rollback_frames: int | None = None, timeline: Timeline = CHARACTERS,
                 batcher: EncodeBatcher | None = None) -> None:
        """``batcher``: the process's shared encode batcher (session_factory makes it), which then encodes
        this session's windows in place of ``encode``."""
        self.encode = encode
        self.batcher = batcher
        self.joined = False  # counted by the batcher's open sessions
        self.timeline = timeline  # the session's: its chunks' spans on the 48 kHz timeline
        cuda = config.device if config.device.startswith("cuda") else None
        # urgent: a turn's first encode is on the reply's path, beside the DiT's kernels of other chunks
        self.worker = StageWorker("conditioning", ENCODE_THREADS, cuda_stream=cuda, urgent=True)
        self.lookahead = ms_samples(lookahead_ms)
        self.context = ms_samples(context_ms)
        self.rollback_wait_s = config.rollback_wait_s  # placement without a ROLLBACK answer after this long
        self.stall_s = config.stall_s  # a speaking turn with no new audio this long is ended
        # Listening chunks at most this many chunks ahead of playout (None: credit alone limits them).
        # Keeps playout's buffer shallow, so little is thrown away and its dispatch never waits for room;
        # capped at the ring's margin (``rollback_frames``), so rewinding to the chunk after the one on
        # screen is exact.
        lead = config.idle_lead_chunks
        self.idle_lead = lead if lead is None or rollback_frames is None else min(lead, rollback_frames)
        self.rollback_frames = rollback_frames
        self._anchor: tuple[int, float] | None = None  # (chunk, monotonic time it is due at playout)
        self._last_emit_at: float | None = None  # wall clock of the last emitted chunk
        self._encode_s: deque[float] = deque(maxlen=ENCODE_HISTORY)  # turns' first speaking chunks' encodes
        self._warm_encode_s = 0.0  # the warm-up's encode: the estimate until a turn has been encoded
        self.next_chunk = 0
        self.epoch = 0
        self.phase = 0  # chunk n starts at media frame n x frames_per_chunk + phase (a re-phased rollback sets it)
        self.turn: _Turn | None = None
        self._closed: OrderedDict[int, None] = OrderedDict()  # finished/interrupted turns: late audio is dropped
        self._pending_stamps: OrderedDict[int, dict[str, float]] = OrderedDict()
        self._changed: anyio.Event | None = None  # created in setup, inside the event loop
        self._silence_tokens: np.ndarray | None = None
        self.errors = 0

    # --- inputs -------------------------------------------------------------------------------

    async def process(self, msg: Message, ctx: StageContext) -> None:
        if isinstance(msg, AgentAudio):
            await self._on_audio(msg, ctx)
        elif isinstance(msg, TurnEvent):
            await self._on_turn_event(msg, ctx)
        else:
            self._error(ctx, None, f"unexpected message {type(msg).__name__}")
        self._wake()

    async def control(self, msg: Control, ctx: StageContext) -> None:
        if msg.kind == ControlKind.ROLLBACK and msg.chunk is not None and msg.epoch > self.epoch:
            self.epoch = msg.epoch
            self.next_chunk = msg.chunk + 1
            self._anchor = (self.next_chunk, _due(msg))
            rollback = msg.payload if isinstance(msg.payload, RollbackPayload) else None
            onset_frame = rollback.onset_frame if rollback is not None else None
            if onset_frame is not None and onset_frame >= self.timeline.frames_per_chunk:
                self._error(ctx, None, f"rollback onset frame {onset_frame} beyond a chunk: speech at the chunk's start")
                onset_frame = 0
            if rollback is not None and rollback.start_frame is not None:  # the grid re-phased: the chunk starts there
                self.phase = rollback.start_frame - self.next_chunk * self.timeline.frames_per_chunk
                onset_frame = 0
            start = self._chunk_start(self.next_chunk)
            turn = self.turn
            # Speech that asked for this rollback, or is placed but not yet committed, starts at the
            # first uncommitted chunk, at the frame playout chose (the frames before it are silent).
            if turn is not None and turn.turn_start_sent_at is not None and (
                    turn.placed_at is None or turn.placed_at >= start):
                turn.placed_at = start + (onset_frame or 0) * self.timeline.samples_per_frame
            placed_at = rollback.placed_at if rollback is not None else None  # a speech placement's: the control's hop
            ctx.log.info("conditioning_rollback", chunk=msg.chunk, epoch=msg.epoch, onset_frame=onset_frame,
                         turn_id=turn.turn_id if turn else None,
                         hop_ms=None if placed_at is None else round((time.time() - placed_at) * 1e3, 1))
        elif msg.kind == ControlKind.CLOCK and msg.chunk is not None:
            self._anchor = (msg.chunk, _due(msg))
        elif msg.kind == ControlKind.INTERRUPT:
            self._interrupt(ctx, msg.trace.turn_id)
        self._wake()

    async def _on_audio(self, msg: AgentAudio, ctx: StageContext) -> None:
        turn_id = msg.trace.turn_id
        samples = msg.samples
        if turn_id is None:
            return self._error(ctx, None, "agent audio without a turn id: dropped")
        if msg.sample_rate != TIMELINE_RATE:
            return self._error(ctx, turn_id, f"agent audio at {msg.sample_rate} Hz; ingest must resample to "
                                             f"{TIMELINE_RATE} Hz: dropped")
        if not isinstance(samples, np.ndarray) or samples.dtype != np.int16 or samples.ndim != 1:
            return self._error(ctx, turn_id, "agent audio must be mono int16 samples, got "
                                             f"{getattr(samples, 'dtype', type(samples))} "
                                             f"{getattr(samples, 'shape', '')}: dropped")
        if turn_id in self._closed:
            return
        turn = self.turn
        if turn is None or turn.turn_id != turn_id:
            if turn is not None:  # a new turn supersedes the old one's remaining speech
                ctx.log.warning("turn superseded", turn_id=turn.turn_id, by_turn_id=turn_id)
                self._close(turn.turn_id)
            trace = TraceContext(turn_id, dict(self._pending_stamps.pop(turn_id, {})))
            trace.stamps.update(msg.trace.stamps)
            trace.stamps.setdefault("agent_first_audio", time.time())
            turn = self.turn = _Turn(turn_id, msg.start_sample, trace)
            ctx.log.info("agent speech begins", turn_id=turn_id)
        offset = msg.start_sample - turn.first_start_sample
        have = len(turn.audio)
        if offset < have:  # overlap with what we already hold: keep the first copy
            samples = samples[have - offset:]
            offset = have
        if offset - have > MAX_GAP_SAMPLES:
            return self._error(ctx, turn_id, f"agent audio jumps {offset - have} samples ahead: dropped")
        if len(samples):
            turn.append(offset, samples)
        turn.last_audio_at = time.monotonic()
        await self._maybe_turn_start(ctx)

    async def _maybe_turn_start(self, ctx: StageContext) -> None:
        """Ask for the rollback once the turn's first chunk can be built."""
        turn = self.turn
        if turn is None or turn.turn_start_sent_at is not None:
            return
        if turn.length < self.timeline.samples_per_chunk + self.lookahead and not turn.ended:
            return
        turn.turn_start_sent_at = time.monotonic()
        payload = TurnStartPayload(
            # a rewind to an earlier chunk would reach past the ring's margin (inexact)
            earliest_chunk=None if self.rollback_frames is None else self.next_chunk - self.rollback_frames,
            last_emit_at=self._last_emit_at,  # the step may still be busy with that chunk
            # the first speaking chunk is encoded once placed
            encode_s=max(self._encode_s, default=self._warm_encode_s),
        )
        ctx.log.info("turn start", turn_id=turn.turn_id, chunk=self.next_chunk, epoch=self.epoch, **vars(payload))
        await ctx.send_control(Control(ctx.session_id, 0, ControlKind.TURN_START, chunk=self.next_chunk,
                                       epoch=self.epoch, payload=payload, trace=TraceContext(turn.turn_id)))

    async def _on_turn_event(self, msg: TurnEvent, ctx: StageContext) -> None:
        turn_id = msg.turn_id
        if msg.kind == TurnKind.INTERRUPT:
            self._interrupt(ctx, turn_id)
        elif msg.kind == TurnKind.AGENT_TURN_END:
            if self.turn is not None and self.turn.turn_id == turn_id:
                self.turn.ended = True
                await self._maybe_turn_start(ctx)
            elif turn_id in self._pending_stamps:  # announced, then ended without a sample: nothing to say
                self._pending_stamps.pop(turn_id)
                self._close(turn_id)
            elif turn_id not in self._closed:
                self._error(ctx, turn_id, "agent turn end without a start: ignored")
        else:  # user speech start/end, agent turn start: their stamps ride on the turn's first chunk
            stamps = dict(msg.trace.stamps)
            if msg.kind == TurnKind.USER_SPEECH_END:
                stamps.setdefault("user_speech_end", msg.at)
            if self.turn is not None and self.turn.turn_id == turn_id:
                for point, at in stamps.items():
                    self.turn.trace.stamps.setdefault(point, at)
            elif turn_id not in self._closed:
                self._pending_stamps.setdefault(turn_id, {}).update(stamps)
                while len(self._pending_stamps) > KEEP_TURN_STAMPS:
                    self._pending_stamps.popitem(last=False)

    def _interrupt(self, ctx: StageContext, turn_id: int | None) -> None:
        turn = self.turn
        if turn is not None and (turn_id is None or turn.turn_id == turn_id):
            ctx.log.info("barge-in: speech dropped, listening", turn_id=turn.turn_id)
            self._close(turn.turn_id)
        elif turn_id is not None:
            self._close(turn_id)  # speech of that turn that arrives later is dropped too

    def _close(self, turn_id: int) -> None:
        if self.turn is not None and self.turn.turn_id == turn_id:
            self.turn = None
        self._closed[turn_id] = None
        while len(self._closed) > KEEP_TURN_STAMPS:
            self._closed.popitem(last=False)

    def _error(self, ctx: StageContext, turn_id: int | None, problem: str) -> None:
        self.errors += 1
        ctx.log.error("bad agent input", turn_id=turn_id, problem=problem)

    def _wake(self) -> None:
        if self._changed is not None:
            self._changed.set()

    # --- the chunk loop ----------------------------------------------------------------------

    async def run(self, ctx: StageContext) -> None:
        silence = np.zeros(self.context + self.timeline.samples_per_chunk + self.lookahead, np.int16)
        for _ in range(2):  # the second, warm, encode: the estimate until a turn has been encoded
            self._silence_tokens, self._warm_encode_s = await self._encode(silence)
        while True:
            wait = self._wait_needed(ctx)
            await self._maybe_turn_start(ctx)  # a stalled agent's short first chunk still starts its turn
            if wait is not None:
                with anyio.move_on_after(wait):
                    await self._changed.wait()
                self._changed = anyio.Event()
                continue
            chunk, epoch = self.next_chunk, self.epoch
            message = await self._build(chunk, epoch)
            self._last_emit_at = time.time()
            await ctx.emit(message)
            if self.epoch == epoch and self.next_chunk == chunk:  # a rollback meanwhile set its own restart
                self.next_chunk = chunk + 1

    def _wait_needed(self, ctx: StageContext) -> float | None:
        """Seconds to wait for input before chunk ``next_chunk`` can be built; None: build it now."""
        turn = self.turn
        now = time.monotonic()
        if turn is None:
            return self._pace(now)
        if turn.placed_at is None:
            if turn.turn_start_sent_at is None:  # still gathering the first chunk: listen just in time
                self._check_stall(ctx, turn, now)
                return self._pace(now, PENDING_LEAD_CHUNKS)
            left = turn.turn_start_sent_at + self.rollback_wait_s - now
            if left > 0:
                return left
            ctx.log.warning("no rollback answer to turn start; speech placed at the next chunk",
                            turn_id=turn.turn_id, chunk=self.next_chunk)
            turn.placed_at = self._chunk_start(self.next_chunk)
        start = self._chunk_start(self.next_chunk) - turn.placed_at
        if turn.ended:
            if start >= turn.length:  # all of the turn's speech is out: back to listening
                self._close(turn.turn_id)
                return self._pace(now)
            return None
        if start < 0 or turn.length >= start + self.timeline.samples_per_chunk + self.lookahead:
            return None
        return None if self._check_stall(ctx, turn, now) else turn.last_audio_at + self.stall_s - now

    def _pace(self, now: float, lead: int | None = None) -> float | None:
        """Seconds until listening chunk ``next_chunk`` may go, ``lead`` chunks (default: the idle
        lead) ahead of its due time at playout (None: now)."""
        lead = self.idle_lead if lead is None else lead
        if lead is None:
            return None
        if self._anchor is None:
            self._anchor = (self.next_chunk, now)
        chunk, at = self._anchor
        due = at + (self.next_chunk - chunk - lead) * self.timeline.chunk_seconds
        return due - now if due > now else None

    def _check_stall(self, ctx: StageContext, turn: _Turn, now: float) -> bool:
        """End a turn whose agent sent nothing for ``stall_s``; True when it did."""
        if turn.ended or now - turn.last_audio_at < self.stall_s:
            return False
        self._error(ctx, turn.turn_id, f"agent audio stalled for {self.stall_s:.1f} s mid-turn: turn ended")
        turn.ended = True
        return True

    def _chunk_start(self, chunk: int) -> int:
        """Chunk ``chunk``'s first sample on the media timeline."""
        return (chunk * self.timeline.frames_per_chunk + self.phase) * self.timeline.samples_per_frame

    async def _build(self, chunk: int, epoch: int) -> Conditioning:
        start = self._chunk_start(chunk)
        start_frame = start // self.timeline.samples_per_frame
        turn = self.turn
        rel = start - turn.placed_at if turn is not None and turn.placed_at is not None else None
        if turn is None or rel is None or rel + self.timeline.samples_per_chunk <= 0 or rel >= turn.length:
            return Conditioning(self._session, chunk, self._silence_tokens, np.zeros(self.timeline.samples_per_chunk, np.int16),
                                speaking=False, epoch=epoch, trace=TraceContext(None).stamp("conditioning_ready"),
                                start_frame=start_frame)
        window = self._window(turn, rel)
        tokens, seconds = await self._encode(window)
        trace = TraceContext(turn.turn_id)
        if rel <= 0:  # the turn's first speaking chunk: it carries the turn's trace, its encode the estimate's
            self._encode_s.append(seconds)
            trace.stamps.update(turn.trace.stamps)
        trace.stamp("conditioning_ready")
        audio = window[self.context:self.context + self.timeline.samples_per_chunk].copy()
        return Conditioning(self._session, chunk, tokens, audio, speaking=True, epoch=epoch, trace=trace,
                            start_frame=start_frame)

    def _window(self, turn: _Turn, rel: int) -> np.ndarray:
        """The encoder's window for the chunk starting ``rel`` samples into the turn's speech: left
        context + the chunk + look-ahead, silence outside the speech."""
        window = np.zeros(self.context + self.timeline.samples_per_chunk + self.lookahead, np.int16)
        first = rel - self.context
        lo, hi = max(first, 0), min(first + len(window), turn.length)
        window[lo - first:hi - first] = turn.audio[lo:hi]
        return window

    async def _encode(self, window: np.ndarray) -> tuple[np.ndarray, float]:
        """``window``'s tokens, and the seconds the encode took."""
        started = time.perf_counter()
        if self.batcher is None:
            tokens = np.asarray(await self.worker.run(self.encode, window), np.float32)
        else:  # shielded, as the worker's calls: a cancelled stage never leaves its window pending there
            with anyio.CancelScope(shield=True):
                tokens = np.asarray(await self.batcher.submit(self, window), np.float32)
        return tokens, time.perf_counter() - started

    async def setup(self, ctx: StageContext) -> None:
        self._session = ctx.session_id
        self._changed = anyio.Event()
        if self.batcher is not None:
            self.batcher.opened()
            self.joined = True

    async def teardown(self) -> None:
        if self.joined:
            self.batcher.closed(self)
        self.worker.close()


def _due(msg: Control) -> float:
    """Monotonic time at which the control's chunk is due at playout (its payload's ``due_at`` wall
    clock; now if it has none)."""
    now = time.monotonic()
    payload = msg.payload
    due_at = payload.due_at if isinstance(payload, ClockPayload | RollbackPayload) else None
    return now if due_at is None else now + due_at - time.time()


def build(config: ConditioningConfig, preset: str, weights: str | None = "packaged", seed: int = 0,
          family: ModelFamily | None = None, batcher: EncodeBatcher | None = None) -> ConditioningStage:
    """The session graph's factory for this stage: the audio conditioner of the session's model
    (``family``, else the family named ``preset``) with its weights (``"packaged"``: shipped ones where
    the package has them; None: seeded random weights), windows as wide as it reads, on its timeline;
    its encodes through the process's ``batcher`` when given."""
    from charstream.model.families import get_family

    family = family or get_family(preset)
    conditioner = family.audio_conditioner(weights, config.device, seed, config.graphed)
    return ConditioningStage(config, conditioner.encode, conditioner.lookahead_ms, conditioner.context_ms,
                             conditioner.rollback_frames, family.timeline, batcher)
