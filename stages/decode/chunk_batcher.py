"""The chunks of one process's ``chunk_motion`` sessions (FlashHead) decoded in one batch
(``decode.batch_sessions`` > 1): the VAE decode, colour match and motion re-encode of each session's
chunk, through a shared ``ChunkRunner`` on a CUDA stream of its own (so a batch decodes while the
diffusion batcher's next batch denoises). Each session's stream then takes its motion latents, as its
own decode would. The scheduling is ``stages/shared/batcher.py``'s.

    batcher = ChunkDecodeBatcher(config.decode, runner)      # one per process: session_factory
    batcher.opened()
    frames = await batcher.decode(stream, latents, chunk)    # uint8 (new frames, H, W, 3)
    batcher.closed(stream)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from charstream.stages.config import DecodeConfig, cpu_threads
from charstream.stages.shared.batcher import SessionBatcher

if TYPE_CHECKING:
    from torch import Tensor

    from charstream.model.families.flashhead.chunks import ChunkMotionStream, ChunkRunner


class ChunkDecodeBatcher(SessionBatcher):
    def __init__(self, config: DecodeConfig, runner: ChunkRunner) -> None:
        super().__init__(config.batch_sessions, config.batch_window_s,
                         cpu_threads(config.threads) if config.device == "cpu" else None, "chunk-decode-batcher")
        self.runner = runner

    async def decode(self, stream: ChunkMotionStream, latents: Tensor, chunk: int | None) -> np.ndarray:
        """The chunk's new frames; the stream's next chunk may then start from its motion latents."""
        return await self.submit(stream, (latents, chunk))

    def forward(self, keys: list[Any], items: list[Any]) -> list[Any]:
        frames, motions = self.runner.decode(keys, [latents for latents, _ in items])
        for stream, (_, chunk), motion in zip(keys, items, motions, strict=True):
            stream.decoded(motion, chunk)
        return frames
