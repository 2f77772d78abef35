"""One run's inputs in device buffers (a CUDA graph reads them) and its output."""

from __future__ import annotations

import torch

from charstream.model.config import ModelConfig
from charstream.model.rope import frame_positions


class StepInputs:
    """A run of ``batch`` frames: per row the noise, the audio tokens, the tokens' positions (B, T, 3), the
    ring write pointer and the ``KVPool`` lane of one session's frame; and the latents it writes."""

    def __init__(self, cfg: ModelConfig, batch: int, device: torch.device) -> None:
        self.noise = torch.zeros(batch, 1, cfg.latent_channels, cfg.latent_height, cfg.latent_width, device=device)
        self.audio = torch.zeros(batch, 1, cfg.n_audio_tokens, cfg.audio_dim, device=device)
        self.positions = frame_positions(0, cfg.grid, cfg.n_audio_tokens, device)[None].repeat(batch, 1, 1)
        self.slot = torch.zeros(batch, dtype=torch.int64, device=device)
        self.lanes = torch.zeros(batch, dtype=torch.int64, device=device)
        self.latent = torch.zeros_like(self.noise)
