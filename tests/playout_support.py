"""Drive one PlayoutStage directly from a test: its setup, clock loop and teardown, and a source
coroutine that calls ``playout.process`` (the runner's duties for one stage, kept in the tests for
unit-level timing; sessions run every stage, the test card included, through the runner)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import structlog

from charstream.stages.base import StageContext
from charstream.stages.playout.stage import PlayoutStage
from charstream.transport.messages import Control, Message

Source = Callable[["PlayoutRun"], Awaitable[None]]  # feeds run.playout (with run.ctx)


@dataclass
class PlayoutRun:
    playout: PlayoutStage
    ctx: StageContext
    controls: list[Control] = field(default_factory=list)  # what playout sent upstream (rollbacks)
    tasks: list[asyncio.Task] = field(default_factory=list)

    async def close(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.playout.teardown()


async def start_playout(session_id: str, playout: PlayoutStage, source: Source) -> PlayoutRun:
    """Run ``playout`` with ``source`` feeding it: the few duties of the runner, for one stage."""
    controls: list[Control] = []

    async def send_control(msg: Control) -> None:
        controls.append(msg)

    async def emit(msg: Message) -> None:  # playout is a sink: nothing downstream
        raise RuntimeError("playout has no downstream edge")

    ctx = StageContext("playout", session_id, emit, send_control, structlog.get_logger("playout").bind(
        session_id=session_id))
    await playout.setup(ctx)
    session = PlayoutRun(playout, ctx, controls)
    session.tasks = [asyncio.create_task(playout.run(ctx), name=f"playout-{session_id}"),
                     asyncio.create_task(source(session), name=f"source-{session_id}")]
    return session
