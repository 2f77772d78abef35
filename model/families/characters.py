"""The characters family: our KV-ring presets (``model/config.py``: tiny, characters-57b, ...) behind the
family interface, one family object per preset.

A thin class: the presets stay data in ``model/config.py``, their loader ``model/weights.py``; this
adds what the serving side asks every family for (timeline, generation mode, audio conditioner).
"""

from __future__ import annotations

from pathlib import Path

import torch

from charstream.model.config import PRESETS, ModelConfig, get_preset
from charstream.model.families.base import (
    AudioConditioner,
    CheckpointError,
    CheckpointReport,
    GenerationMode,
    ModelFamily,
    meta_flops,
)
from charstream.timeline import CHARACTERS, Timeline


class CharactersFamily(ModelFamily):
    variants = tuple(PRESETS)

    def __init__(self, preset: str) -> None:
        self._config = get_preset(preset)  # an unknown preset is refused with the known ones
        self.name = self.variant = preset

    @property
    def config(self) -> ModelConfig:
        return self._config

    @property
    def timeline(self) -> Timeline:
        return CHARACTERS

    @property
    def generation_mode(self) -> GenerationMode:
        return "kv_ring"

    def parameter_count(self) -> int:
        from charstream.model.dit import DiT

        with torch.device("meta"):
            return sum(p.numel() for p in DiT(self._config).parameters())

    def flops_per_chunk(self) -> dict[str, int]:
        """A chunk is one step: the DiT's passes with the window full (model/dit.py ``step_flops``) and the
        decode of its latent frame (PyTorch's FLOP counter on the meta device)."""
        from charstream.model.dit import DiT, step_flops
        from charstream.model.vae import Decoder

        cfg = self._config
        with torch.device("meta"):
            denoise = step_flops(DiT(cfg))
        latent = (cfg.latent_channels, cfg.latent_height, cfg.latent_width)
        return {"denoise": denoise, "decode": meta_flops(lambda: Decoder(cfg).decode_chunk(torch.zeros(latent)))}

    def inspect(self, weights_dir: str | Path) -> CheckpointReport:
        from charstream.model.dit import DiT
        from charstream.model.families.flashhead.loader import read_safetensors_header

        path = Path(weights_dir)
        if not path.is_file():
            raise CheckpointError(path, f"no weights file (a {self.name} checkpoint is one .safetensors file)")
        specs = read_safetensors_header(path)
        with torch.device("meta"):
            wanted = {k: tuple(t.shape) for k, t in DiT(self._config).state_dict().items()}
        mismatched = tuple(f"{k}: file {specs[k].shape}, model {shape}" for k, shape in wanted.items()
                           if k in specs and tuple(specs[k].shape) != shape)
        return CheckpointReport(
            family="characters", variant=self.name, weights=str(path), files=(path.name,),
            params=sum(torch.Size(s).numel() for s in wanted.values()),
            stored_params=sum(torch.Size(s.shape).numel() for s in specs.values()), tensors=len(specs),
            missing=tuple(sorted(set(wanted) - set(specs))), mismatched=mismatched,
            ignored=tuple(sorted(set(specs) - set(wanted))))  # the VAE and the audio encoder beside the DiT

    def load(self, weights: str | Path, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32,
             seed: int = 0) -> torch.nn.Module:
        from charstream.model.weights import build_model

        return build_model(self._config, None if weights == "random" else weights, device, dtype, seed=seed)

    def audio_conditioner(self, weights: str | None, device: str = "cpu", seed: int = 0,
                          graphed: bool = True) -> AudioConditioner:
        from charstream.model.audio_encoder import AudioEncoder, make_encode_fn
        from charstream.model.weights import load_audio_encoder, resolve_weights

        cfg = self._config
        path = resolve_weights(cfg.name, weights)
        if path:
            encoder = load_audio_encoder(cfg, Path(path))
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                encoder = AudioEncoder(cfg).eval().requires_grad_(False)
        encoder = encoder.to(device)
        if graphed and device.startswith("cuda"):
            from charstream.model.graphed_audio_encoder import GraphedAudioEncoder

            encode = GraphedAudioEncoder(encoder).encode
        else:
            encode = make_encode_fn(encoder)
        return AudioConditioner(encode, cfg.audio_context_ms, cfg.audio_lookahead_ms, cfg.rollback_frames)
