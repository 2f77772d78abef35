"""One decoder forward for the due chunks of many sessions (``DecodeConfig.batch_sessions`` > 1).

    batch = BatchedDecoder(decoder, max_sessions=64, graphed=True)
    frames, states = batch.decode(latents, [state, ...])   # latents (n, C, h, w); state: each session's
                                                           # after its previous chunk (None: a fresh one)

Sessions own their state: a ``CausalState`` per chunk, immutable, kept by the session's decode stage
(so a rollback continues from the committed chunk's state by passing it in again, as alone). A forward
gathers the n states into static history buffers (one ``cat`` per causal layer), runs the decoder once
over the n latent frames, and hands back each session's new state as its row of the forward's new
history. Rows never mix (every layer works per pixel, per frame or per image), so row i is the chunk
the session would decode alone; on CPU bit for bit (``vae.conv_per_clip``), on CUDA within cuDNN's
choice of algorithm per batch size. ``graphed`` (CUDA) captures one graph per bucket (1, 2, 4, ...
``max_sessions``) on the static buffers; a batch of n runs its bucket's graph, the padding rows
computing whatever the buffers hold, read by no one.
"""

from __future__ import annotations

import functools

import torch

from charstream.model.graphs import capture_graph, one_capture_at_a_time
from charstream.model.step.batched import BUCKETS
from charstream.model.vae import CausalState, Decoder, to_uint8_frames


class BatchedDecoder:
    def __init__(self, decoder: Decoder, max_sessions: int, graphed: bool = False,
                 buckets: tuple[int, ...] = BUCKETS) -> None:
        """``decoder`` in the dtype and on the device it serves with (graphed: converted to channels-last,
        as ``GraphedDecoder`` does)."""
        dev = decoder.latent_mean.device
        if graphed and dev.type != "cuda":
            raise ValueError("a graphed batched decoder needs a CUDA device")
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.decoder = decoder.to(memory_format=torch.channels_last).eval() if graphed else decoder.eval()
        self.cfg, self.device, self.graphed, self.max_sessions = decoder.cfg, dev, graphed, max_sessions
        self.buckets = sorted({b for b in buckets if b < max_sessions} | {max_sessions})
        cfg, dtype = self.cfg, decoder.latent_mean.dtype
        self.latent = torch.zeros(max_sessions, 1, cfg.latent_channels, cfg.latent_height, cfg.latent_width,
                                  device=dev, dtype=dtype)
        with torch.inference_mode():
            _, first = self.decoder.decode_chunk(self.latent[0, 0])  # the history's shapes
        self.zeros = tuple(torch.zeros_like(c) for c in first.caches)  # a fresh session's history, (1, 2, H, W, C) each
        self.history = [c.new_zeros((max_sessions, *c.shape[1:])) for c in first.caches]
        self.outputs: dict[int, tuple[torch.Tensor, tuple[torch.Tensor, ...]]] = {}  # bucket -> the graph's frames, history
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        if graphed:
            self.capture()

    def check_state(self, state: CausalState | None) -> None:
        """Raise unless ``state`` is a state of this decoder (or None / empty: a fresh session)."""
        if state is None or not state.caches:
            return
        if len(state.caches) != len(self.zeros) or any(
                c is None or c.shape != z.shape or c.dtype != z.dtype or c.device != z.device
                for c, z in zip(state.caches, self.zeros, strict=False)):
            got = [None if c is None else (tuple(c.shape), c.dtype) for c in state.caches]
            raise ValueError(f"not a decoder state of this batched decoder: {got}, "
                             f"expected {[(tuple(z.shape), z.dtype) for z in self.zeros]}")

    def bucket(self, n: int) -> int:
        """The batch size (and graph) a batch of ``n`` sessions runs at."""
        return next(b for b in self.buckets if b >= n)

    @torch.inference_mode()
    def decode(self, latents: torch.Tensor, states: list[CausalState | None],
               graphed: bool | None = None) -> tuple[torch.Tensor, list[CausalState]]:
        """Row i of ``latents`` (n, C, h, w), decoded from ``states[i]``: uint8 frames (n, frames_per_chunk,
        H, W, 3) on the device (graphed: a static buffer the next call overwrites) and each session's state
        after its chunk. ``graphed``: replay the bucket's graph (default: the decoder's mode) or run eagerly at n."""
        n = len(states)
        if not 0 < n <= self.max_sessions or latents.shape[0] != n:
            raise ValueError(f"a batch of {latents.shape[0]} latent frames for {n} states (1 to {self.max_sessions})")
        for state in states:
            self.check_state(state)  # before anything moves
        self.latent[:n, 0].copy_(latents)
        for layer, buffer in enumerate(self.history):
            rows = [s.caches[layer] if s is not None and s.caches else self.zeros[layer] for s in states]
            torch.cat(rows, out=buffer[:n])
        if self.graphed if graphed is None else graphed:
            if not self.graphs:
                raise RuntimeError("a graphed run before capture()")
            bucket = self.bucket(n)
            self.graphs[bucket].replay()
            frames, history = self.outputs[bucket]
            history = tuple(h[:n].clone() for h in history)  # the graph's outputs are overwritten by the next replay
        else:
            frames, history = self._body(n)
        after = [CausalState(tuple(h[i : i + 1] for h in history), (s.frames if s is not None else 0) + 1)
                 for i, s in enumerate(states)]
        return frames[:n], after

    @one_capture_at_a_time
    @torch.inference_mode()
    def capture(self, warmup: int = 2) -> None:
        """One CUDA graph per bucket (model/graphs.py), sharing one memory pool (they never replay concurrently)."""
        self.capture_stream = torch.cuda.Stream()
        memory = torch.cuda.graph_pool_handle()
        for bucket in self.buckets:
            self.graphs[bucket], self.outputs[bucket] = capture_graph(functools.partial(self._body, bucket),
                                                                      self.capture_stream, warmup, memory)

    def _body(self, n: int) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]]:
        video, state = self.decoder(self.latent[:n], CausalState(tuple(h[:n] for h in self.history)))
        return to_uint8_frames(video), state.caches
