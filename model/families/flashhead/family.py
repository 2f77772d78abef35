"""SoulX-FlashHead as a model family: Pro (Wan2.1 VAE) and Lite (LTX-Video VAE)."""

from __future__ import annotations

from pathlib import Path

import torch

from charstream.model.families.base import CheckpointReport, GenerationMode, ModelFamily, Timeline
from charstream.model.families.flashhead.config import VARIANTS, FlashHeadConfig
from charstream.model.families.flashhead.loader import (
    FlashHeadModel,
    inspect_folder,
    load_flashhead,
    used_shapes,
)


class FlashHeadFamily(ModelFamily):
    variants = tuple(VARIANTS)

    def __init__(self, variant: str, audio_encoder: str | Path | None = None) -> None:
        if variant not in VARIANTS:
            raise ValueError(f"unknown FlashHead variant {variant!r} (known: {', '.join(VARIANTS)})")
        self.variant = variant
        self.name = VARIANTS[variant].name
        self.audio_encoder = audio_encoder  # wav2vec2-base-960h, if not in or beside the weights folder

    @property
    def config(self) -> FlashHeadConfig:
        return VARIANTS[self.variant]

    @property
    def timeline(self) -> Timeline:
        cfg = self.config
        return Timeline(fps=cfg.fps, new_frames_per_chunk=cfg.new_frames_per_chunk, audio_rate=cfg.sample_rate)

    @property
    def generation_mode(self) -> GenerationMode:
        return "chunk_motion"

    def parameter_count(self) -> int:
        return sum(torch.Size(s).numel() for s in used_shapes(self.config).values())

    def inspect(self, weights_dir: str | Path) -> CheckpointReport:
        return inspect_folder(weights_dir, self.variant, self.audio_encoder)[0]

    def load(
        self, weights: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32, seed: int = 0
    ) -> FlashHeadModel:
        return load_flashhead(weights, self.variant, device, dtype, seed, self.audio_encoder)
