"""Stages for the decode stage's process test (importable by factory path in a spawned process)."""

from __future__ import annotations

import anyio
import numpy as np

from charstream.model.config import get_preset
from charstream.stages.base import Stage, StageContext
from charstream.timeline import CHARACTERS
from charstream.transport.messages import Control, ControlKind, Latents, Message, TraceContext, VideoChunk


def latents_for(chunk: int, epoch: int, preset: str = "tiny") -> np.ndarray:
    """Deterministic latents of one chunk: the same in the test and in a spawned stage."""
    cfg = get_preset(preset)
    rng = np.random.default_rng(1_000 * epoch + chunk)
    return rng.standard_normal((cfg.latent_channels, cfg.latent_height, cfg.latent_width)).astype(np.float32)


def audio_for(chunk: int) -> np.ndarray:
    return np.full(CHARACTERS.samples_per_chunk, chunk, np.int16)


def latents_message(session_id: str, chunk: int, epoch: int, turn_id: int | None = None) -> Latents:
    return Latents(session_id, chunk, latents_for(chunk, epoch), audio_for(chunk), turn_id is not None, epoch,
                   TraceContext(turn_id))


class LatentsSource(Stage):
    """Emits chunks 0..first-1 in epoch 0; after a ROLLBACK to ``c``, chunks c+1..first-1 in its epoch."""

    def __init__(self, first: int) -> None:
        self.first = first
        self.rollback: Control | None = None

    async def setup(self, ctx: StageContext) -> None:
        self._rolled = anyio.Event()

    async def run(self, ctx: StageContext) -> None:
        for chunk in range(self.first):
            await ctx.emit(latents_message(ctx.session_id, chunk, 0, turn_id=7 if chunk == 1 else None))
        await self._rolled.wait()
        for chunk in range(self.rollback.chunk + 1, self.first):
            await ctx.emit(latents_message(ctx.session_id, chunk, self.rollback.epoch))

    async def control(self, msg: Control, ctx: StageContext) -> None:
        if msg.kind == ControlKind.ROLLBACK:
            self.rollback = msg
            self._rolled.set()


class FrameSink(Stage):
    """Keeps every VideoChunk; after ``first`` chunks rolls back to ``rollback_to``, then shuts down
    once the regenerated chunks are in."""

    def __init__(self, first: int, rollback_to: int) -> None:
        self.first, self.rollback_to = first, rollback_to
        self.chunks: list[VideoChunk] = []

    async def process(self, msg: Message, ctx: StageContext) -> None:
        assert isinstance(msg, VideoChunk)
        self.chunks.append(msg)
        if len(self.chunks) == self.first:
            await ctx.send_control(Control(ctx.session_id, 1, ControlKind.ROLLBACK, chunk=self.rollback_to, epoch=1))
        if len(self.chunks) == 2 * self.first - self.rollback_to - 1:
            await ctx.send_control(Control(ctx.session_id, 2, ControlKind.SHUTDOWN))
