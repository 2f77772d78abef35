"""Real inproc sessions for the batching tests: what each releases, batched or alone.

With the listening agent and no microphone every chunk is a listening chunk, so chunk n's frames
depend on the session's seed only: the same sessions batched and alone must release equal frames.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import numpy as np
import structlog

from charstream.pipeline.config import PipelineConfig
from charstream.pipeline.session import LiveSession
from charstream.stages.base import Stage, StageContext
from charstream.stages.decode.batcher import DecodeBatcher
from charstream.stages.diffusion.batcher import StepBatcher
from charstream.stages.shared.batcher import SessionBatcher
from charstream.transport.messages import Control, ControlKind, Message


def seeded_configs(steps: int, decodes: int, seeds: tuple[int, ...] = (1, 2, 3)) -> list[PipelineConfig]:
    """One config per seed, with ``batch_sessions`` of diffusion = ``steps`` and of decode = ``decodes``."""
    configs = []
    for seed in seeds:
        config = PipelineConfig()
        config.diffusion.seed = seed
        config.diffusion.batch_sessions, config.decode.batch_sessions = steps, decodes
        configs.append(config)
    return configs


async def released_frames(configs: list[PipelineConfig], frames: int, step_batcher: StepBatcher | None = None,
                          decode_batcher: DecodeBatcher | None = None) -> list[dict]:
    """Each session's first ``frames`` generated frames by (chunk, frame in chunk); every session ends ok."""
    sessions = [LiveSession(c, f"s{c.diffusion.seed}", peer=False, batcher=step_batcher,
                            decode_batcher=decode_batcher) for c in configs]
    for s in sessions:
        s.start()
    released: list[dict] = [{} for _ in sessions]

    async def read(i: int) -> None:
        out, index = sessions[i].output, 0
        await out.wait_started()
        while len(released[i]) < frames:
            frame = await out.frame_at(index)
            index = frame.index + 1
            if frame.chunk is not None:
                released[i][(frame.chunk, frame.frame_in_chunk)] = frame.image

    await asyncio.wait_for(asyncio.gather(*(read(i) for i in range(len(sessions)))), 90)
    results = [await s.stop() for s in sessions]
    assert all(r is not None and r.ok for r in results), [r and r.error for r in results]
    return released


def assert_same_frames(together: list[dict], alone: list[dict], at_least: int) -> None:
    """Every frame both runs released is equal, at least ``at_least`` of them per session; sessions differ."""
    for got, want in zip(together, alone, strict=True):
        shared = sorted(set(got) & set(want))
        assert len(shared) >= at_least
        for key in shared:
            np.testing.assert_array_equal(got[key], want[key])
    assert not np.array_equal(together[0][shared[-1]], together[1][shared[-1]])


def recording_context(stage: str, session: str, out: list) -> StageContext:
    """A stage's context for session ``session`` whose emitted messages land in ``out`` (controls dropped)."""
    async def emit(msg) -> None:
        out.append(msg)

    async def send_control(msg) -> None:
        pass

    return StageContext(stage, session, emit, send_control, structlog.get_logger())


async def play_plan(stage: Stage, ctx: StageContext, plan: list[tuple[str, int, int]],
                    message: Callable[[int, int], Message]) -> None:
    """``plan`` through ``stage``, set up before and torn down after: ("r", last committed, epoch) a
    ROLLBACK, any other (kind, chunk, epoch) the data ``message(chunk, epoch)``."""
    await stage.setup(ctx)
    try:
        for kind, chunk, epoch in plan:
            if kind == "r":
                await stage.control(Control(ctx.session_id, 0, ControlKind.ROLLBACK, chunk=chunk, epoch=epoch), ctx)
            else:
                await stage.process(message(chunk, epoch), ctx)
    finally:
        await stage.teardown()


async def alone_then_together(play: Callable[[str, Any, Any], Awaitable[list]], plans: dict, batcher: Any,
                              config: Any, batched: Any) -> tuple[dict[str, list], dict[str, list]]:
    """Each plan's ``play(name, None, config)`` one after another, then with ``batcher`` (``batched``
    config): a, b and c at once, d joining once c has left (a pool of 3 reuses c's lane). Returns
    what each emitted alone and together, by plan name."""
    alone = {name: await play(name, None, config) for name in plans}
    together: dict[str, list] = {}

    async def run(name: str, wait: anyio.Event | None = None, done: anyio.Event | None = None) -> None:
        if wait is not None:
            await wait.wait()
        together[name] = await play(name, batcher, batched)
        if done is not None:
            done.set()

    c_done = anyio.Event()
    async with anyio.create_task_group() as tg:
        tg.start_soon(run, "a")
        tg.start_soon(run, "b")
        tg.start_soon(run, "c", None, c_done)
        tg.start_soon(run, "d", c_done)
    return alone, together


def assert_emitted_alike(alone: dict[str, list], together: dict[str, list]) -> None:
    """Every plan emitted the same (chunk, epoch) sequence and equal arrays together as alone."""
    for name in alone:
        assert [(c, e) for c, e, _ in together[name]] == [(c, e) for c, e, _ in alone[name]], name
        for (_, _, got), (_, _, want) in zip(together[name], alone[name], strict=True):
            np.testing.assert_array_equal(got, want)


def worker_ended(b: SessionBatcher) -> bool:
    """The worker thread ends with the last session (it may still be leaving its loop when that one left)."""
    worker = b._worker
    if worker is not None:
        worker.join(10)
    return b._worker is None
