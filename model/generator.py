"""The per-session generator: DiT + KV ring cache + sampler on one TP rank.

    gen = Generator(cfg, weights, device, tp_group=None)
    gen.reset_session(reference_latent)          # writes the sink frame, fixes FP8 scales
    latent = gen.step(audio_tokens, seed)        # one chunk: 4 passes, last pass's K/V stay
    gen.rollback(k)                              # turn-start rollback: forget the last k frames

Under TP every rank runs the same calls with the same inputs (rank 0 does the I/O and broadcasts).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from charstream.kernels.fp8 import FP8_DTYPE
from charstream.kernels.rope import complex_rotation, rope_freqs, rope_rotation, rotate_complex
from charstream.model.cache import KVCache
from charstream.model.config import ModelConfig
from charstream.model.rope import frame_positions
from charstream.model.sampler import sample, seeded_noise
from charstream.model.weights import build_model


class RingSelfAttention:
    """Self-attention of one frame (or the sink) through the ring cache: write K/V, attend in place."""

    def __init__(self, cache: KVCache, positions: torch.Tensor) -> None:
        self.cache, self.positions = cache, positions
        # RoPE of the queries and keys of every layer, built once per step (the CUDA ring-write kernel
        # rotates the keys itself and ignores it); one complex multiply rotates a tensor.
        self.rotation = complex_rotation(rope_rotation(positions, cache.freqs))

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        shape = q.shape  # (1, F, T, H, D)
        q, k, v = (t.reshape(-1, *shape[-2:]) for t in (q, k, v))
        self.cache.write(layer, k, v, self.positions, self.rotation)
        return self.cache.attend(layer, rotate_complex(q, self.rotation).to(q.dtype)).reshape(shape)


class Generator:
    def __init__(
        self,
        cfg: ModelConfig,
        weights: str | Path | None = None,
        device: torch.device | str = "cpu",
        tp_group: dist.ProcessGroup | None = None,
        dtype: torch.dtype = torch.float32,
        fp8_cache: bool = True,
        cache_slots: int | None = None,
        seed: int = 0,
    ) -> None:
        world = dist.get_world_size(tp_group) if tp_group is not None else 1
        self.cfg = cfg.validate(world)
        self.device = torch.device(device)
        self.model = build_model(cfg, weights, self.device, dtype, tp_group, seed)
        self.freqs = rope_freqs(cfg.head_dim, self.device)
        kv_dtype = FP8_DTYPE if fp8_cache else dtype
        self.cache = KVCache(cfg, cfg.n_heads // world, kv_dtype, self.device, self.freqs, n_slots=cache_slots)
        self._session = False

    @property
    def next_frame(self) -> int:
        """Index (since the session's start) of the frame the next ``step`` generates."""
        return self.cache.next_frame

    def _positions(self, t: int) -> torch.Tensor:
        return frame_positions(t, self.cfg.grid, self.cfg.n_audio_tokens, self.device)

    def _latent_shape(self) -> tuple[int, int, int]:
        return self.cfg.latent_channels, self.cfg.latent_height, self.cfg.latent_width

    @torch.inference_mode()
    def reset_session(self, reference_latent: torch.Tensor) -> None:
        """Start a session: the reference latent (C, h, w) becomes the sink frame(s), clean (sigma 0)."""
        cfg = self.cfg
        if tuple(reference_latent.shape[-3:]) != self._latent_shape():
            raise ValueError(f"reference latent has shape {tuple(reference_latent.shape)}, expected {self._latent_shape()}")
        ref = reference_latent.to(self.device).reshape(1, 1, *self._latent_shape()).expand(1, cfg.sink_frames, -1, -1, -1)
        audio = torch.zeros(1, cfg.sink_frames, cfg.n_audio_tokens, cfg.audio_dim, device=self.device)
        positions = torch.cat([self._positions(t) for t in range(cfg.sink_frames)])
        # The sampler's levels are fixed and the weights too within a session: their adaLN once.
        self._modulations = {s: self.model.modulation(torch.full((1, 1), s, device=self.device)) for s in cfg.noise_levels}
        self.cache.reset()
        self.cache.begin_sink()
        self.model(ref, torch.zeros(1, cfg.sink_frames, device=self.device), audio, RingSelfAttention(self.cache, positions))
        self._session = True

    @torch.inference_mode()
    def step(self, audio_tokens: torch.Tensor, seed: int) -> torch.Tensor:
        """Generate the next latent frame (C, h, w), float32, from audio tokens (n_audio_tokens, audio_dim)."""
        cfg = self.cfg
        if not self._session:
            raise RuntimeError("step() before reset_session(): the sink frame is not written")
        if tuple(audio_tokens.shape) != (cfg.n_audio_tokens, cfg.audio_dim):
            raise ValueError(f"audio tokens have shape {tuple(audio_tokens.shape)}, expected {(cfg.n_audio_tokens, cfg.audio_dim)}")
        _, t = self.cache.begin_frame()
        attn = RingSelfAttention(self.cache, self._positions(t))
        audio = audio_tokens.to(self.device).reshape(1, 1, *audio_tokens.shape)
        cross_kv = self.model.cross_context(audio)

        def velocity(x: torch.Tensor, sigma: float) -> torch.Tensor:
            level = torch.full((1, 1), sigma, device=self.device)  # only read if no modulation were given
            return self.model(x, level, audio, attn, cross_kv, self._modulations[sigma])

        noise = seeded_noise((1, 1, *self._latent_shape()), seed).to(self.device)
        latent = sample(velocity, noise, cfg.noise_levels)
        self.cache.end_frame()
        return latent[0, 0]

    def rollback(self, k: int) -> int:
        """Forget the last ``k`` generated frames; returns how many context frames could not be restored
        (0 when ``k`` <= cfg.rollback_frames: then regenerating equals never having generated them)."""
        return self.cache.rollback(k)
