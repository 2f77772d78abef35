"""The due chunks of one process's sessions decoded in one forward (``DecodeConfig.batch_sessions`` > 1).

The sessions of one serving process share one decoder and one ``model.batched_decoder.BatchedDecoder``;
each session's decode stage keeps its own temporal cache states (the recent ones a rollback continues
from), epochs and chunk order, and submits each chunk with the state it continues from. The scheduling
-- window, due set, bounded pending, worker thread, failures -- is ``stages/shared/batcher.py``'s
``SessionBatcher``, shared with the diffusion step's batcher.

    batcher = DecodeBatcher(config.decode, preset, weights, seed)   # one per process: session_factory
    batcher.join(stage)                                   # (blocking) the first join builds the decoder
    frames, state = await batcher.decode(stage, latent, state)   # uint8 (4, H, W, 3) numpy, the state after
    batcher.leave(stage)

On CUDA the forwards run on a stream of their own, so their copies wait for no diffusion forward.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import numpy as np

from charstream.model.config import get_preset
from charstream.stages.config import DecodeConfig, cpu_threads
from charstream.stages.shared.batcher import SessionBatcher

if TYPE_CHECKING:
    from charstream.model.batched_decoder import BatchedDecoder
    from charstream.model.vae import CausalState


class DecodeBatcher(SessionBatcher):
    def __init__(self, config: DecodeConfig, preset: str, weights: str | None = "packaged", seed: int = 0) -> None:
        """``seed``: the decoder's weights when ``weights`` is None (seeded random)."""
        self.device = config.device
        cuda = self.device.startswith("cuda")
        super().__init__(config.batch_sessions, config.batch_window_s,
                         None if cuda else cpu_threads(config.threads), "decode-batcher")
        self.preset, self.weights, self.seed = preset, weights, seed
        self.cfg = get_preset(preset)
        self.graphed = config.graphed and cuda
        self.dtype = "bfloat16" if cuda else "float32"
        self.batch: BatchedDecoder | None = None  # built by the first join
        self._stream: Any = None

    def join(self, session: object) -> None:
        """(blocking) ``session`` (its own object) joins; the first join loads the decoder and captures its graphs."""
        with self.model_lock:
            if self.batch is None:
                self.batch = self._build()
        self.opened()

    def leave(self, session: object) -> None:
        """A chunk of ``session`` still waiting is dropped."""
        self.closed(session)

    def _build(self) -> BatchedDecoder:
        import torch

        from charstream.model.batched_decoder import BatchedDecoder
        from charstream.model.weights import load_decoder, resolve_weights

        decoder = load_decoder(self.preset, resolve_weights(self.preset, self.weights), self.device, self.dtype, self.seed)
        batch = BatchedDecoder(decoder, self.max_sessions, graphed=self.graphed)
        if self.device.startswith("cuda"):
            self._stream = torch.cuda.Stream(self.device)
            self._stream.wait_stream(torch.cuda.current_stream())  # the buffers it starts from are made there
        return batch

    async def decode(self, session: object, latent: np.ndarray, state: CausalState | None) -> tuple[np.ndarray, CausalState]:
        """``latent`` (C, h, w) decoded from ``state`` (None: the session starts here): its uint8 frames
        (frames_per_chunk, H, W, 3) and the state after it, from the next forward that takes it."""
        return await self.submit(session, (latent, state))

    def check(self, session: object, item: tuple[np.ndarray, CausalState | None]) -> None:
        latent, state = item
        expected = (self.cfg.latent_channels, self.cfg.latent_height, self.cfg.latent_width)
        if tuple(latent.shape) != expected:
            raise ValueError(f"latents {tuple(latent.shape)}, expected {expected}")
        self.batch.check_state(state)

    def forward(self, sessions: list[object], items: list[tuple[np.ndarray, CausalState | None]]) -> list[Any]:
        import torch

        latents = torch.from_numpy(np.stack([latent for latent, _ in items]).astype(np.float32, copy=False))
        with torch.cuda.stream(self._stream) if self._stream is not None else nullcontext():
            frames, states = self.batch.decode(latents, [state for _, state in items])
            rows = frames.cpu().numpy()
        return list(zip(rows, states, strict=True))

