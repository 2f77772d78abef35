"""SoulX-FlashHead as a model family: Pro (Wan2.1 VAE) and Lite (LTX-Video VAE)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from charstream.model.families.base import AudioConditioner, CheckpointReport, GenerationMode, ModelFamily
from charstream.model.families.flashhead.config import VARIANTS, FlashHeadConfig
from charstream.model.families.flashhead.loader import (
    WAV_VAE,
    FlashHeadModel,
    inspect_folder,
    load_flashhead,
    used_shapes,
)
from charstream.timeline import Timeline

if TYPE_CHECKING:
    from charstream.model.families.flashhead.chunks import ChunkMotionStream


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
        model = self.load(_weights(weights), device, seed=seed)
        encoder = ChunkSpeechEncoder(self._config, model.speech, model.adapter)
        return AudioConditioner(encoder.encode, encoder.context_ms, 0.0)

    def chunk_stream(self, weights: str | None, portrait: np.ndarray, device: str = "cpu", seed: int = 0) -> ChunkMotionStream:
        """One session's chunk stream (``chunks.py``): the DiT and wav2vec2 of ``weights`` (a released folder,
        or None / ``"random"``: seeded random weights of this config), the Wan VAE of the folder's
        ``VAE_Wan/Wan2.1_VAE.pth`` (random: seeded), the ``portrait`` (RGB uint8) encoded once."""
        from charstream.model.families.flashhead.chunks import ChunkMotionStream, portrait_tensor
        from charstream.model.families.flashhead.vae_wan import WanVAE, load_wan_vae

        if self.variant != "pro":
            raise ValueError(f"{self.name}: only FlashHead Pro (the Wan2.1 VAE) streams chunks so far")
        weights = _weights(weights)
        model = self.load(weights, device, seed=seed)
        if weights == "random":
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                vae = WanVAE().to(device).eval().requires_grad_(False)
        else:
            vae = load_wan_vae(Path(weights) / WAV_VAE, device)
        cfg = self._config
        return ChunkMotionStream(model, vae, portrait_tensor(portrait, cfg.height, cfg.width), seed)


def _weights(weights: str | Path | None) -> str | Path:
    """None is seeded random weights, as for every family; FlashHead ships no weights of its own."""
    if weights == "packaged":
        raise ValueError("FlashHead ships no weights: give its weights folder (Soul-AILab/SoulX-FlashHead) or 'random'")
    return "random" if weights is None else weights
