"""Where each of a frame's tokens sits for RoPE (time, height, width); the rotation math is
``charstream.kernels.rope`` (the kernels fuse it, their references use it)."""

from __future__ import annotations

import torch


def frame_positions(t: int, grid: tuple[int, int], n_audio_tokens: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """Positions (T, 3) of one frame's tokens: video tokens on the (h, w) grid, then audio at h = w = 0."""
    gh, gw = grid
    hh, ww = torch.meshgrid(torch.arange(gh), torch.arange(gw), indexing="ij")
    video = torch.stack([torch.full((gh * gw,), t), hh.flatten(), ww.flatten()], dim=-1)
    audio = torch.zeros(n_audio_tokens, 3, dtype=torch.long)
    audio[:, 0] = t
    return torch.cat([video, audio]).to(device=device, dtype=torch.long)
