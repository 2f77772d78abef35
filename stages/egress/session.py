"""A self-contained egress session without the model: a test-card source feeding a real PlayoutStage.

``testcard_session`` is a ``SessionFactory`` for ``EgressServer``: it runs the PlayoutStage stage on
its own (setup, clock loop, teardown) with a source that produces test-card chunks at the real
24 fps rate, one flash+click chunk every ``flash_every`` chunks. Tests, benchmarks and
``charstream serve --source testcard`` use it; the full pipeline's session graph provides its own
factory returning the same ``SessionMedia``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import structlog

from pipeline.config import EgressConfig, PlayoutConfig
from stages.base import StageContext
from stages.egress.mic import UserAudioQueue
from stages.egress.server import SessionMedia
from stages.egress.testcard import card_chunk
from stages.playout import PlayoutStage
from transport.messages import CHUNK_SECONDS, Control, Message


@dataclass
class TestcardSession:
    playout: PlayoutStage
    ctx: StageContext
    controls: list[Control] = field(default_factory=list)  # what playout sent upstream (rollbacks)
    tasks: list[asyncio.Task] = field(default_factory=list)

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.playout.teardown()


async def start_playout(session_id: str, playout: PlayoutStage,
                        source: Callable[[PlayoutStage, StageContext], Awaitable[None]]) -> TestcardSession:
    """Run ``playout`` with ``source`` feeding it: the few duties of the runner, for one stage."""
    controls: list[Control] = []

    async def send_control(msg: Control) -> None:
        controls.append(msg)

    async def emit(msg: Message) -> None:  # playout is a sink: nothing downstream
        raise RuntimeError("playout has no downstream edge")

    ctx = StageContext("playout", session_id, emit, send_control, structlog.get_logger("playout").bind(
        session_id=session_id))
    await playout.setup(ctx)
    session = TestcardSession(playout, ctx, controls)
    session.tasks = [asyncio.create_task(playout.run(ctx), name=f"playout-{session_id}"),
                     asyncio.create_task(source(playout, ctx), name=f"source-{session_id}")]
    return session


def realtime_card(height: int = 128, width: int = 128, flash_every: int = 12, speaking: bool = False):
    """A source producing test-card chunks on absolute deadlines at the media rate."""

    async def source(playout: PlayoutStage, ctx: StageContext) -> None:
        start = time.monotonic()
        chunk = 0
        while True:
            await playout.process(card_chunk(ctx.session_id, chunk, height, width,
                                                 flash=flash_every > 0 and chunk % flash_every == 0,
                                                 speaking=speaking, epoch=playout.epoch), ctx)
            chunk += 1
            delay = start + chunk * CHUNK_SECONDS - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)

    return source


def card_factory(playout_config: PlayoutConfig | None = None, egress_config: EgressConfig | None = None,
                 height: int = 128, width: int = 128, flash_every: int = 12,
                 source: Callable[[PlayoutStage, StageContext], Awaitable[None]] | None = None):
    """A ``SessionFactory`` serving the test card (or ``source``); ``factory.sessions`` holds the live ones."""
    egress_config = egress_config or EgressConfig()
    source = source or realtime_card(height, width, flash_every)
    sessions: dict[str, TestcardSession] = {}

    async def factory(session_id: str) -> SessionMedia:
        session = await start_playout(session_id, PlayoutStage(playout_config), source)
        sessions[session_id] = session

        async def close() -> None:
            sessions.pop(session_id, None)
            await session.close()

        return SessionMedia(session.playout.output, UserAudioQueue(egress_config.user_audio_queue_frames),
                            close=close)

    factory.sessions = sessions  # type: ignore[attr-defined]
    return factory
