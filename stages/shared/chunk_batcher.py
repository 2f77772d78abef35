"""The chunks of one process's ``chunk_motion`` sessions (FlashHead) run in one batch: their denoising
(``diffusion.batch_sessions`` > 1) and their decoding (``decode.batch_sessions`` > 1).

A FlashHead chunk's DiT passes over one session's 1,280 (Lite) or 2,304 (Pro) tokens leave the GPU's
matrix units partly idle; the sessions of one serving process share the model, so their due chunks run
as one batch through a shared ``ChunkRunner`` (``model/families/flashhead/chunks.py``), each batcher's on
a CUDA stream of its own (a batch decodes while the next denoises). Each session's stream keeps its
motion latents, portrait, colour reference and noise, so its chunk is the one it would make alone. The
scheduling -- window, bounded pending, worker thread, failures -- is ``batcher.py``'s. On CUDA a graphed
runner (the default) captures a CUDA graph for every batch size when its batcher is made, on the making
thread, before any session runs GPU work beside the capture; an ungraphed one's worker thread first runs
a batch of every size (``prepare``: cuDNN's per-thread timing), so the first session waits for that once.

    denoiser = ChunkDenoiseBatcher(config.diffusion, runner)   # one each per process: session_factory
    decoder = ChunkDecodeBatcher(config.decode, runner)
    denoiser.opened(); decoder.opened()                        # a session's stages start
    stream.ready(chunk, start=start_frame)                     # (blocking) its previous chunk decoded
    latents = await denoiser.denoise(stream, tokens)           # (1, C, latents, h, w), complete
    frames = await decoder.decode(stream, latents, lead)       # uint8 (new frames, H, W, 3); lead(first frames)
    denoiser.closed(stream); decoder.closed(stream)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from charstream.stages.config import DecodeConfig, DiffusionConfig, cpu_threads
from charstream.stages.shared.batcher import SessionBatcher

if TYPE_CHECKING:
    from torch import Tensor

    from charstream.model.families.flashhead.chunks import ChunkMotionStream, ChunkRunner


class _ChunkBatcher(SessionBatcher):
    part: str  # the runner's method: denoise or decode

    def __init__(self, config: DiffusionConfig | DecodeConfig, runner: ChunkRunner, name: str) -> None:
        super().__init__(config.batch_sessions, config.batch_window_s,
                         cpu_threads(config.threads) if config.device == "cpu" else None, name)
        self.runner = runner
        if runner.graphed:  # replays time no convolution: the worker thread has nothing to prepare
            runner.warm(self.part, self.max_sessions)

    def prepare(self) -> None:
        """On CUDA without graphs, a batch of every size this thread will run, before the first session's
        chunk: cuDNN times each convolution once per shape and thread, which would otherwise stall every
        session in the batch that first meets a size."""
        if self.runner.cuda_stream is not None and not self.runner.graphed:
            self.runner.warm(self.part, self.max_sessions)


class ChunkDenoiseBatcher(_ChunkBatcher):
    part = "denoise"

    def __init__(self, config: DiffusionConfig, runner: ChunkRunner) -> None:
        super().__init__(config, runner, "chunk-denoise-batcher")

    async def denoise(self, stream: ChunkMotionStream, tokens: np.ndarray) -> Tensor:
        """The stream's chunk from its audio tokens, once ``stream.ready`` has returned."""
        return await self.submit(stream, tokens)

    def forward(self, keys: list[Any], items: list[Any]) -> list[Any]:
        return self.runner.denoise(keys, items)


class ChunkDecodeBatcher(_ChunkBatcher):
    part = "decode"

    def __init__(self, config: DecodeConfig, runner: ChunkRunner) -> None:
        super().__init__(config, runner, "chunk-decode-batcher")

    async def decode(self, stream: ChunkMotionStream, latents: Tensor,
                     lead: Callable[[np.ndarray], None] | None = None) -> np.ndarray:
        """The chunk's new frames; the stream's next chunk may then start from its motion latents. ``lead``:
        called with its first frames while the rest decodes (``ChunkRunner.decode``), on the batch's thread."""
        return await self.submit(stream, (latents, lead))

    def forward(self, keys: list[Any], items: list[Any]) -> list[Any]:
        frames, motions = self.runner.decode(keys, [latents for latents, _ in items], [lead for _, lead in items])
        for stream, motion, shown in zip(keys, motions, frames, strict=True):
            stream.decoded(motion, shown)
        return frames
