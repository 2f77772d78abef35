"""The naive reference generator, kept for tests: what the ring cache must equal.

Raw (un-rotated, unquantized) K/V of every generated frame are kept; each step copies the last
W-1 frames into a fresh window, re-applies RoPE to the whole window at the current positions and
runs plain attention. No ring, no FP8, no delta rotation: position resets and rollbacks are just
different positions and a shorter history.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from charstream.kernels.rope import apply_rope, rope_freqs
from charstream.model.cache import position_offset
from charstream.model.dit import DiT
from charstream.model.rope import frame_positions
from charstream.model.sampler import sample, seeded_noise


class _WindowAttention:
    def __init__(self, gen: NaiveGenerator, past_k: list[torch.Tensor], past_v: list[torch.Tensor],
                 past_positions: torch.Tensor, positions: torch.Tensor) -> None:
        self.gen, self.past_k, self.past_v = gen, past_k, past_v
        self.past_positions, self.positions = past_positions, positions
        self.new_k: list[torch.Tensor | None] = [None] * len(past_k)
        self.new_v: list[torch.Tensor | None] = [None] * len(past_k)

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        shape = q.shape
        q, k, v = (t.reshape(-1, *shape[-2:]) for t in (q, k, v))
        self.new_k[layer], self.new_v[layer] = k, v  # the last pass's survive as context
        keys = torch.cat([self.past_k[layer], k])
        values = torch.cat([self.past_v[layer], v])
        keys = apply_rope(keys, torch.cat([self.past_positions, self.positions]), self.gen.freqs)
        q = apply_rope(q, self.positions, self.gen.freqs)
        out = F.scaled_dot_product_attention(q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None])
        return out[0].transpose(0, 1).reshape(shape)


class NaiveGenerator:
    """Same API as model.generator.Generator (TP world 1), over a given DiT."""

    def __init__(self, model: DiT) -> None:
        self.model, self.cfg = model, model.cfg
        self.device = model.head.weight.device
        self.freqs = rope_freqs(self.cfg.head_dim, self.device)
        self.history: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []  # raw K/V per frame
        n_layers = self.cfg.n_blocks
        self.sink: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])
        empty = torch.zeros(0, self.cfg.n_heads, self.cfg.head_dim, device=self.device, dtype=model.head.weight.dtype)
        self._empty = [empty] * n_layers

    def _positions(self, t: int) -> torch.Tensor:
        return frame_positions(t, self.cfg.grid, self.cfg.n_audio_tokens, self.device)

    @torch.inference_mode()
    def reset_session(self, reference_latent: torch.Tensor) -> None:
        cfg = self.cfg
        ref = reference_latent.to(self.device).reshape(1, 1, *reference_latent.shape[-3:]).expand(1, cfg.sink_frames, -1, -1, -1)
        audio = torch.zeros(1, cfg.sink_frames, cfg.n_audio_tokens, cfg.audio_dim, device=self.device)
        positions = torch.cat([self._positions(t) for t in range(cfg.sink_frames)])
        attn = _WindowAttention(self, self._empty, self._empty, positions[:0], positions)
        self.model(ref, torch.zeros(1, cfg.sink_frames, device=self.device), audio, attn)
        self.sink = (attn.new_k, attn.new_v)
        self.sink_positions = positions
        self.history = []

    @torch.inference_mode()
    def step(self, audio_tokens: torch.Tensor, seed: int) -> torch.Tensor:
        cfg = self.cfg
        n = len(self.history)
        offset = position_offset(n, cfg.window_frames, cfg.reset_every)
        first = max(0, n - cfg.window_frames + 1)
        window = self.history[first:]
        # The window is rebuilt by copying every step, and every key is re-rotated below.
        past_k = [torch.cat([self.sink[0][i], *(f[0][i] for f in window)]) for i in range(cfg.n_blocks)]
        past_v = [torch.cat([self.sink[1][i], *(f[1][i] for f in window)]) for i in range(cfg.n_blocks)]
        past_positions = torch.cat(
            [self.sink_positions, *(self._positions(cfg.sink_frames + f - offset) for f in range(first, n))]
        )
        attn = _WindowAttention(self, past_k, past_v, past_positions, self._positions(cfg.sink_frames + n - offset))
        audio = audio_tokens.to(self.device).reshape(1, 1, *audio_tokens.shape)

        def velocity(x: torch.Tensor, sigma: float) -> torch.Tensor:
            return self.model(x, torch.full((1, 1), sigma, device=self.device), audio, attn)

        noise = seeded_noise((1, 1, cfg.latent_channels, cfg.latent_height, cfg.latent_width), seed).to(self.device)
        latent = sample(velocity, noise, cfg.noise_levels)
        self.history.append((attn.new_k, attn.new_v))
        return latent[0, 0]

    def rollback(self, k: int) -> int:
        del self.history[len(self.history) - k :]
        return 0
