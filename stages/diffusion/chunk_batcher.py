"""The chunks of one process's ``chunk_motion`` sessions (FlashHead) denoised in one batch
(``diffusion.batch_sessions`` > 1).

A FlashHead chunk's DiT passes over one session's 1,280 (Lite) or 2,304 (Pro) tokens leave the GPU's
matrix units partly idle; the sessions of one serving process share the model, so their due chunks run
as one batch through a shared ``ChunkRunner`` (``model/families/flashhead/chunks.py``): each session's
stream keeps its motion latents, portrait and noise, so its chunk is the one it would make alone. The
scheduling -- window, bounded pending, worker thread, failures -- is ``stages/shared/batcher.py``'s.

    batcher = ChunkDenoiseBatcher(config.diffusion, runner)   # one per process: session_factory
    batcher.opened()                                         # a session's diffusion stage starts
    stream.ready(chunk)                                      # (blocking) its previous chunk decoded
    latents = await batcher.denoise(stream, tokens)          # (1, C, latents, h, w), complete
    batcher.closed(stream)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from charstream.stages.config import DiffusionConfig, cpu_threads
from charstream.stages.shared.batcher import SessionBatcher

if TYPE_CHECKING:
    from torch import Tensor

    from charstream.model.families.flashhead.chunks import ChunkMotionStream, ChunkRunner


class ChunkDenoiseBatcher(SessionBatcher):
    def __init__(self, config: DiffusionConfig, runner: ChunkRunner) -> None:
        super().__init__(config.batch_sessions, config.batch_window_s,
                         cpu_threads(config.threads) if config.device == "cpu" else None, "chunk-denoise-batcher")
        self.runner = runner

    async def denoise(self, stream: ChunkMotionStream, tokens: np.ndarray) -> Tensor:
        """The stream's chunk from its audio tokens, once ``stream.ready`` has returned."""
        return await self.submit(stream, tokens)

    def forward(self, keys: list[Any], items: list[Any]) -> list[Any]:
        return self.runner.denoise(keys, items)
