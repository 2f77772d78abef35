"""SoulX-FlashHead as a model family: Pro (Wan2.1 VAE) and Lite (LTX-Video VAE)."""

from __future__ import annotations

from pathlib import Path

import torch

from charstream.model.families.base import AudioConditioner, CheckpointReport, GenerationMode, ModelFamily
from charstream.model.families.flashhead.config import VARIANTS, FlashHeadConfig
from charstream.model.families.flashhead.loader import (
    FlashHeadModel,
    inspect_folder,
    load_flashhead,
    used_shapes,
)
from charstream.timeline import Timeline


class FlashHeadFamily(ModelFamily):
    variants = tuple(VARIANTS)

    def __init__(self, variant: str, audio_encoder: str | Path | None = None,
                 config: FlashHeadConfig | None = None) -> None:
        if variant not in VARIANTS:
            raise ValueError(f"unknown FlashHead variant {variant!r} (known: {', '.join(VARIANTS)})")
        self.variant = variant
        self._config = config or VARIANTS[variant]  # another size of the variant (tests: fewer blocks)
        self.name = self._config.name
        self.audio_encoder = audio_encoder  # wav2vec2-base-960h, if not in or beside the weights folder

    @property
    def config(self) -> FlashHeadConfig:
        return self._config

    @property
    def timeline(self) -> Timeline:
        cfg = self.config
        return Timeline(fps=cfg.fps, frames_per_chunk=cfg.new_frames_per_chunk)

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
        return load_flashhead(weights, self.variant, device, dtype, seed, self.audio_encoder, self._config)

    def audio_conditioner(self, weights: str | None, device: str = "cpu", seed: int = 0,
                          graphed: bool = True) -> AudioConditioner:
        from charstream.model.families.flashhead.conditioner import ChunkSpeechEncoder

        # the adapter comes with the DiT's checkpoint; the DiT itself is dropped here (diffusion loads its own)
        model = self.load(weights or "random", device, seed=seed)
        encoder = ChunkSpeechEncoder(self._config, model.speech, model.adapter)
        return AudioConditioner(encoder.encode, encoder.context_ms, 0.0)
