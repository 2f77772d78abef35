"""The causal VAE decoder (model/vae.py) on a GPU: bf16, channels-last, one CUDA graph per chunk.

``GraphedDecoder(decoder)`` keeps the decoder's causal history in static buffers that the graph
updates in place, and writes each chunk's uint8 frames (frames_per_chunk, H, W, 3) into a static
output, so a chunk costs one graph replay. ``snapshot()``/``restore()`` copy the history out and back
for a rollback (the eager decoder's immutable ``CausalState`` does the same by reference);
``decode_chunk(latent, state)`` is ``Decoder.decode_chunk``'s contract on top of them (uint8 frames out).
"""

from __future__ import annotations

import torch

from charstream.model.graphs import capture_graph, one_capture_at_a_time
from charstream.model.vae import CausalState, Decoder, to_uint8_frames


class GraphedDecoder:
    def __init__(self, decoder: Decoder, dtype: torch.dtype = torch.bfloat16) -> None:
        self.decoder = decoder.to(dtype=dtype, memory_format=torch.channels_last).eval()
        cfg = decoder.cfg
        dev = next(decoder.parameters()).device
        self.latent = torch.zeros(cfg.latent_channels, cfg.latent_height, cfg.latent_width, device=dev, dtype=dtype)
        with torch.inference_mode():
            _, first = self.decoder.decode_chunk(self.latent)  # the history's shapes
        self.history = [torch.zeros_like(c) for c in first.caches]
        self.seen = 0  # latent frames the history holds
        self.live: CausalState | None = None  # the snapshot equal to the history buffers now
        self._capture()

    def _body(self) -> torch.Tensor:
        video, new = self.decoder.decode_chunk(self.latent, CausalState(tuple(self.history)))
        frames = to_uint8_frames(video)
        for old, fresh in zip(self.history, new.caches, strict=True):
            old.copy_(fresh)
        return frames

    @one_capture_at_a_time
    @torch.inference_mode()
    def _capture(self) -> None:
        saved = self.snapshot()
        self.capture_stream = torch.cuda.Stream()  # kept (model/graphs.py says why)
        self.graph, self.frames = capture_graph(self._body, self.capture_stream)
        self.restore(saved)

    @torch.inference_mode()
    def decode(self, latent: torch.Tensor) -> torch.Tensor:
        """One latent frame (C, h, w) -> uint8 frames (frames_per_chunk, H, W, 3), a static buffer
        overwritten by the next call."""
        self.latent.copy_(latent)
        self.graph.replay()
        return self.frames

    @torch.inference_mode()
    def decode_chunk(self, latent: torch.Tensor, state: CausalState | None = None) -> tuple[torch.Tensor, CausalState]:
        """``Decoder.decode_chunk`` on the graph: continue from ``state`` (None: a fresh session), return
        the uint8 frames (a static buffer) and the state after this chunk (a copy of the history, so a
        rollback can return to it). Continuing from the last returned state costs no copy back."""
        if state is None:
            self.reset()
        elif state is not self.live:
            self.restore(state)
        frames = self.decode(latent)
        self.seen += 1
        self.live = self.snapshot()
        return frames, self.live

    def reset(self) -> None:
        """A new session: zero history."""
        for h in self.history:
            h.zero_()
        self.seen, self.live = 0, None

    def snapshot(self) -> CausalState:
        return CausalState(tuple(h.clone() for h in self.history), self.seen)

    def restore(self, saved: CausalState) -> None:
        for h, s in zip(self.history, saved.caches, strict=True):
            h.copy_(s)
        self.seen, self.live = saved.frames, saved
