"""Diffusion for ``chunk_motion`` families (SoulX-FlashHead): ``Conditioning`` -> ``Latents``, one whole chunk
(9 latents) denoised per message by the session's chunk stream (``model/families/flashhead/chunks.py``).

The stream is shared with the decode stage: its ``denoise`` waits until the previous chunk is decoded,
because that chunk's last frames, re-encoded, are this chunk's motion latents. Both stages therefore run
in the session's process (group ``main``), where live objects are handed in, never pickled. Conditioning
of an epoch a rollback ended is dropped unmade: a turn's first speech chunk would otherwise wait for the
whole chunks (denoise and decode) queued before it. With a ``batcher`` (``diffusion.batch_sessions`` > 1,
``stages/shared/chunk_batcher.py``) the chunk, once its stream is ready, is denoised in a batch with other sessions'.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np

from charstream.stages.base import Stage, StageContext
from charstream.stages.config import DiffusionConfig, cpu_threads
from charstream.stages.diffusion.stage import DiffusionStats
from charstream.stages.shared.worker import StageWorker
from charstream.transport.messages import Conditioning, Control, ControlKind, Latents, Message

if TYPE_CHECKING:
    from charstream.stages.shared.chunk_batcher import ChunkDenoiseBatcher

READY_POLL_S = 0.25  # a stopping session's diffusion waits at most this long for a decode that will not come


class ChunkDiffusionStage(Stage):
    name = "diffusion"

    def __init__(self, config: DiffusionConfig, stream: Any, token_shape: tuple[int, ...],
                 batcher: ChunkDenoiseBatcher | None = None) -> None:
        """``batcher``: the process's shared chunk batcher (session_factory makes it)."""
        self.stream = stream
        self.batcher = batcher
        self.joined = False  # counted by the batcher's open sessions
        self.token_shape = tuple(token_shape)  # (latents, audio tokens, d) a chunk
        self.worker = StageWorker("diffusion", cpu_threads(config.threads) if config.device == "cpu" else None)
        self.epoch = 0
        self.stats = DiffusionStats()  # a step is a chunk's denoising here

    async def setup(self, ctx: StageContext) -> None:
        if self.batcher is not None:
            self.batcher.opened()
            self.joined = True
        await self.worker.run(self.stream.warm_thread)  # a turn start's re-encode runs on this thread

    async def process(self, msg: Message, ctx: StageContext) -> None:
        tokens = getattr(msg, "audio_tokens", None)
        if not isinstance(msg, Conditioning) or not isinstance(tokens, np.ndarray) \
                or tokens.shape != self.token_shape or not np.isfinite(tokens).all():
            self.stats.bad += 1
            ctx.log.error("diffusion_bad_conditioning", chunk=getattr(msg, "chunk", None),
                          problem=f"expected finite audio tokens {self.token_shape}, got "
                                  f"{type(msg).__name__} {getattr(tokens, 'shape', None)}")
            return
        if msg.epoch < self.epoch:
            self.stats.stale += 1
            ctx.log.debug("diffusion_stale", chunk=msg.chunk, epoch=msg.epoch, current=self.epoch)
            return
        self.epoch = msg.epoch
        await self._ready(msg.chunk, msg.start_frame)  # its previous chunk decoded: not the step's time
        started = time.perf_counter()
        if self.batcher is None:
            (latents,) = await self.worker.run(self.stream.runner.denoise, [self.stream], [tokens])
        else:
            latents = await self.batcher.denoise(self.stream, tokens)
        self.stats.last_step_s = time.perf_counter() - started
        self.stats.step_s.append(self.stats.last_step_s)
        self.stats.generated += 1
        msg.trace.stamp("diffusion_done")
        await ctx.emit(Latents(msg.session_id, msg.chunk, latents[0].float().cpu().numpy(), msg.audio, msg.speaking,
                               msg.epoch, msg.trace, msg.start_frame))

    async def _ready(self, chunk: int, start: int | None) -> None:
        """The stream ready for ``chunk``, starting at media frame ``start``, waited for in short turns of the
        worker: a call on it is shielded
        from cancellation (torch work is never abandoned), and the decode a stopping session waits for may
        never come (its stream is closed only at teardown, after this returns)."""
        while True:
            try:
                return await self.worker.run(self.stream.ready, chunk, READY_POLL_S, start)
            except TimeoutError:
                continue

    async def control(self, msg: Control, ctx: StageContext) -> None:
        if msg.kind == ControlKind.ROLLBACK:  # the chunks to come carry the new epoch; the stream continues
            self.epoch = max(self.epoch, msg.epoch)
            self.stats.rollbacks += 1

    async def teardown(self) -> None:
        self.stream.close()  # releases a denoise waiting for a decode that will not come
        if self.joined:
            self.batcher.closed(self.stream)
        self.worker.close()
