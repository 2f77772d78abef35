"""Teacher-forced training forward over a clip of frames, matching what inference computes.

At inference the context of frame n is the K/V of frames n-W+1 .. n-1 as written by their LAST
sampler pass, i.e. computed from each frame's latent at the last noise level (0.25), while each
attended only to the sink and its own window. Training reproduces that in one batched forward:
the sequence is [sink | context frames 0..F-1 (clean latents noised to the last level) | target
frames 0..F-1 (noised to a random sampler level)] and a block-causal mask lets

    sink      attend the sink,
    context j attend sink + context j-W+1 .. j,
    target j  attend sink + context j-W+1 .. j-1 + itself.

Time positions start at a random offset so the model sees every position the ring takes between
two position resets (sink_frames .. sink_frames + W + R - 1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from charstream.kernels.rope import RopeFreqs, rope_freqs, rope_rotation, rotate
from charstream.model.config import ModelConfig
from charstream.model.dit import DiT
from charstream.model.rope import frame_positions


def clip_layout(cfg: ModelConfig, n_frames: int, t_offset: int, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Positions (S, 3) and the boolean attention mask (S, S) of [sink | context | target] frames."""
    sink, w = cfg.sink_frames, cfg.window_frames
    n_total = sink + 2 * n_frames
    frame_mask = torch.zeros(n_total, n_total, dtype=torch.bool)
    frame_mask[:, :sink] = True
    for j in range(n_frames):
        oldest = max(0, j - w + 1)
        frame_mask[sink + j, sink + oldest : sink + j + 1] = True  # context j: its window incl. itself
        frame_mask[sink + n_frames + j, sink + oldest : sink + j] = True  # target j: the window before it
        frame_mask[sink + n_frames + j, sink + n_frames + j] = True  # ... and itself
    t = cfg.tokens_per_step
    mask = frame_mask.repeat_interleave(t, 0).repeat_interleave(t, 1)
    times = [*range(sink), *(2 * [sink + t_offset + j for j in range(n_frames)])]
    positions = torch.cat([frame_positions(tt, cfg.grid, cfg.n_audio_tokens) for tt in times])
    return positions.to(device), mask.to(device)


class MaskedSelfAttention:
    """Self-attention over the whole clip sequence with RoPE at fixed positions and a mask."""

    def __init__(self, positions: torch.Tensor, mask: torch.Tensor, freqs: RopeFreqs) -> None:
        self.mask = mask
        self.rotation = rope_rotation(positions, freqs)  # computed once, used by every layer

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        shape = q.shape  # (B, F, T, H, D)
        q, k, v = (x.flatten(1, 2) for x in (q, k, v))  # (B, S, H, D)
        q, k = rotate(q, *self.rotation).to(q.dtype), rotate(k, *self.rotation).to(k.dtype)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=self.mask)
        return out.transpose(1, 2).reshape(shape)


def teacher_forced_velocity(
    model: DiT,
    reference: torch.Tensor,
    context: torch.Tensor,
    context_sigma: torch.Tensor,
    target: torch.Tensor,
    target_sigma: torch.Tensor,
    audio_tokens: torch.Tensor,
    t_offset: int = 0,
) -> torch.Tensor:
    """Velocity (B, F, C, h, w) for every target frame in one forward.

    reference (B, C, h, w) clean sink latent; context, target (B, F, C, h, w) noisy latents at
    context_sigma, target_sigma (B, F); audio_tokens (B, F, A, audio_dim), shared by a frame's
    context and target copies.
    """
    cfg = model.cfg
    b, n_frames = target.shape[:2]
    sink = cfg.sink_frames
    latents = torch.cat([reference[:, None].expand(b, sink, *reference.shape[1:]), context, target], dim=1)
    sigma = torch.cat([torch.zeros(b, sink, device=target.device), context_sigma, target_sigma], dim=1)
    silence = torch.zeros(b, sink, *audio_tokens.shape[2:], device=audio_tokens.device, dtype=audio_tokens.dtype)
    audio = torch.cat([silence, audio_tokens, audio_tokens], dim=1)
    positions, mask = clip_layout(cfg, n_frames, t_offset, target.device)
    attn = MaskedSelfAttention(positions, mask, rope_freqs(cfg.head_dim, target.device))
    return model(latents, sigma, audio, attn)[:, sink + n_frames :]
