"""A self-contained egress session without the model: a test-card source feeding a real PlayoutStage.

``card_factory`` is a ``SessionFactory`` for ``EgressServer``. Per session it runs the playout
stage on its own (setup, clock loop, teardown) and a source that behaves like the generator:
it produces test-card chunks as fast as playout's backpressure lets it, one flash+click chunk
every ``flash_every`` chunks. The user's microphone goes through silero-vad; at each end of user
speech the session does what the full pipeline does on a turn start — playout rolls back the
unplayed chunks and the source regenerates from ``last_committed + 1`` with "speech" (a red
border and a higher tone) for ``turn_chunks`` chunks, stamping the turn's trace — so the page's
latency overlay shows real figures: back-dated end of speech → first speaking frame on screen,
with an agent that answers instantly. Tests, benchmarks and ``charstream serve --source
testcard`` use it; the full pipeline's session graph provides its own factory returning the
same ``SessionMedia``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import numpy as np
import structlog
from charstream.stages.base import StageContext
from charstream.stages.config import EgressConfig, PlayoutConfig
from charstream.stages.egress.mic import UserAudioClosed, UserAudioQueue
from charstream.stages.egress.server import SessionMedia
from charstream.stages.egress.testcard import card_chunk
from charstream.stages.playout import FRAME_SECONDS, PlayoutStage
from charstream.transport.messages import Control, Message, TurnKind

from charstream.timeline import TIMELINE_RATE

Source = Callable[["CardSession"], Awaitable[None]]  # feeds session.playout (with session.ctx)


@dataclass
class CardSession:
    playout: PlayoutStage
    ctx: StageContext
    controls: list[Control] = field(default_factory=list)  # what playout sent upstream (rollbacks)
    tasks: list[asyncio.Task] = field(default_factory=list)
    turn_starts: asyncio.Queue[float] = field(default_factory=lambda: asyncio.Queue(maxsize=4))  # user speech ends
    vad_events: list = field(default_factory=list)
    mic_frames: int = 0
    mic_peak_rms: float = 0.0

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.playout.teardown()


async def start_playout(session_id: str, playout: PlayoutStage, source: Source) -> CardSession:
    """Run ``playout`` with ``source`` feeding it: the few duties of the runner, for one stage."""
    controls: list[Control] = []

    async def send_control(msg: Control) -> None:
        controls.append(msg)

    async def emit(msg: Message) -> None:  # playout is a sink: nothing downstream
        raise RuntimeError("playout has no downstream edge")

    ctx = StageContext("playout", session_id, emit, send_control, structlog.get_logger("playout").bind(
        session_id=session_id))
    await playout.setup(ctx)
    session = CardSession(playout, ctx, controls)
    session.tasks = [asyncio.create_task(playout.run(ctx), name=f"playout-{session_id}"),
                     asyncio.create_task(source(session), name=f"source-{session_id}")]
    return session


def card_source(height: int, width: int, flash_every: int, turn_chunks: int) -> Source:
    """Test-card chunks as fast as backpressure allows; a turn start rolls back and "speaks"."""

    async def source(session: CardSession) -> None:
        playout, ctx = session.playout, session.ctx
        chunk, turn_id, speaking_left = 0, 0, 0
        while True:
            trace_stamps = {}
            speech_end = None
            # While the buffer is full, wait for room or a turn start, whichever comes first.
            while playout.stats.depth >= playout.config.max_depth_chunks and speech_end is None:
                try:
                    speech_end = await asyncio.wait_for(session.turn_starts.get(), FRAME_SECONDS)
                except TimeoutError:
                    pass
            if speech_end is None and not session.turn_starts.empty():
                speech_end = session.turn_starts.get_nowait()
            if speech_end is not None:
                rollback = await playout.rollback(ctx)
                chunk, turn_id, speaking_left = rollback.chunk + 1, turn_id + 1, turn_chunks
                trace_stamps = {"user_speech_end": speech_end, "agent_first_audio": time.time()}
            speaking = speaking_left > 0
            msg = card_chunk(ctx.session_id, chunk, height, width, flash=flash_every > 0 and chunk % flash_every == 0,
                             speaking=speaking, epoch=playout.epoch, turn_id=turn_id if speaking else None)
            msg.trace.stamps.update(trace_stamps)
            await playout.process(msg, ctx)
            chunk += 1
            speaking_left = max(speaking_left - 1, 0)

    return source


async def listen(session: CardSession, user_audio: UserAudioQueue) -> None:
    """The user's mic through silero-vad; each end of speech starts a turn."""
    from charstream.stages.ingest.vad import UserAudioVAD  # already imported by card_factory

    vad = None
    while True:
        try:
            frame = await user_audio.get()
        except UserAudioClosed:
            return
        if vad is None:  # the model loads off the event loop, once a mic is heard
            vad = await asyncio.to_thread(UserAudioVAD, sample_rate=TIMELINE_RATE)
        session.mic_frames += 1
        rms = float(np.sqrt(np.mean(frame.samples.astype(np.float64) ** 2)))
        session.mic_peak_rms = max(session.mic_peak_rms, rms)
        for event in vad.feed(frame.samples, frame.received_at - len(frame.samples) / TIMELINE_RATE):
            session.vad_events.append(event)
            session.ctx.log.info("user_vad", kind=str(event.kind), at=event.at, probability=round(event.probability, 2))
            if event.kind == TurnKind.USER_SPEECH_END and not session.turn_starts.full():
                session.turn_starts.put_nowait(event.at)


def card_factory(playout_config: PlayoutConfig | None = None, egress_config: EgressConfig | None = None,
                 height: int = 128, width: int = 128, flash_every: int = 12, turn_chunks: int = 18,
                 source: Source | None = None, vad: bool = True):
    """A ``SessionFactory`` serving the test card (or ``source``); ``factory.sessions`` holds the live ones."""
    if vad:
        import charstream.stages.ingest.vad  # noqa: F401  torch + silero now, not in the middle of a session's stream

    egress_config = egress_config or EgressConfig()
    sessions: dict[str, CardSession] = {}

    async def factory(session_id: str) -> SessionMedia:
        user_audio = UserAudioQueue(egress_config.user_audio_queue_frames)
        session = await start_playout(session_id, PlayoutStage(playout_config or PlayoutConfig()),
                                      source or card_source(height, width, flash_every, turn_chunks))
        if vad:  # otherwise the mic queue just fills and drops (counted)
            session.tasks.append(asyncio.create_task(listen(session, user_audio), name=f"vad-{session_id}"))
        sessions[session_id] = session

        async def close() -> None:
            sessions.pop(session_id, None)
            await session.close()

        return SessionMedia(session.playout.output, user_audio, close=close)

    factory.sessions = sessions  # type: ignore[attr-defined]
    return factory
