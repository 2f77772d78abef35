"""The causal VAE decoder (model/vae.py) on a GPU: bf16, channels-last, one CUDA graph per chunk.

``GraphedDecoder(decoder)`` keeps the decoder's causal history in static buffers that the graph
updates in place, and writes each chunk's uint8 frames (frames_per_chunk, H, W, 3) into a static
output, so a chunk costs one graph replay. ``snapshot()``/``restore()`` copy the history out and back
for a rollback (the eager decoder's immutable ``CausalState`` does the same by reference).
"""

from __future__ import annotations

import torch

from model.vae import CausalState, Decoder, to_uint8_frames


class GraphedDecoder:
    def __init__(self, decoder: Decoder, dtype: torch.dtype = torch.bfloat16) -> None:
        self.decoder = decoder.to(dtype=dtype, memory_format=torch.channels_last).eval()
        cfg = decoder.cfg
        dev = next(decoder.parameters()).device
        self.latent = torch.zeros(cfg.latent_channels, cfg.latent_height, cfg.latent_width, device=dev, dtype=dtype)
        with torch.inference_mode():
            _, first = self.decoder.decode_chunk(self.latent)  # the history's shapes
        self.history = [torch.zeros_like(c) for c in first.caches]
        self.frames: torch.Tensor | None = None
        self.graph = torch.cuda.CUDAGraph()
        self._capture()

    def _body(self) -> torch.Tensor:
        video, new = self.decoder.decode_chunk(self.latent, CausalState(tuple(self.history)))
        frames = to_uint8_frames(video)
        for old, fresh in zip(self.history, new.caches, strict=True):
            old.copy_(fresh)
        return frames

    @torch.inference_mode()
    def _capture(self) -> None:
        saved = self.snapshot()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._body()
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(self.graph):
            self.frames = self._body()
        self.restore(saved)

    @torch.inference_mode()
    def decode(self, latent: torch.Tensor) -> torch.Tensor:
        """One latent frame (C, h, w) -> uint8 frames (frames_per_chunk, H, W, 3), a static buffer
        overwritten by the next call."""
        self.latent.copy_(latent)
        self.graph.replay()
        return self.frames

    def reset(self) -> None:
        """A new session: zero history."""
        for h in self.history:
            h.zero_()

    def snapshot(self) -> list[torch.Tensor]:
        return [h.clone() for h in self.history]

    def restore(self, saved: list[torch.Tensor]) -> None:
        for h, s in zip(self.history, saved, strict=True):
            h.copy_(s)
