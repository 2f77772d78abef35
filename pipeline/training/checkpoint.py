"""The trained ``tiny`` character in one safetensors file (model/assets/tiny.safetensors).

Layout: the DiT's tensors under their own names (what ``model.weights.load_weights`` reads; it
ignores other keys), the VAE's under ``vae.``, the audio encoder's under ``audio_encoder.``.
A training run writes the DiT and the rest as two files (each fits the 16 MB limit of a file
coming back from the GPU machine); ``merge`` joins them into the shipped file.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from model.audio_encoder import AudioEncoder
from model.config import ModelConfig
from model.dit import DiT
from model.vae import VideoVAE
from model.weights import save_weights

VAE_PREFIX = "vae."
AUDIO_PREFIX = "audio_encoder."


def save_parts(out_dir: Path, dit: DiT, vae: VideoVAE, audio_encoder: AudioEncoder) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    dit_path, rest_path = out_dir / "dit.safetensors", out_dir / "vae_audio.safetensors"
    save_weights(dit, dit_path)
    rest = {VAE_PREFIX + k: v.detach().float().contiguous().cpu() for k, v in vae.state_dict().items()}
    rest |= {AUDIO_PREFIX + k: v.detach().float().contiguous().cpu() for k, v in audio_encoder.state_dict().items()}
    save_file(rest, str(rest_path), metadata={"preset": dit.cfg.name})
    return dit_path, rest_path


def merge(parts: list[Path], out: Path) -> Path:
    tensors: dict[str, torch.Tensor] = {}
    for part in parts:
        with safe_open(str(part), framework="pt", device="cpu") as f:
            for key in f.keys():
                if key in tensors:
                    raise ValueError(f"{part}: tensor {key!r} is also in an earlier part")
                tensors[key] = f.get_tensor(key)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out), metadata={"preset": "tiny"})
    return out


def _load_prefixed(module: torch.nn.Module, path: Path, prefix: str) -> None:
    with safe_open(str(path), framework="pt", device="cpu") as f:
        keys = [k for k in f.keys() if k.startswith(prefix)]
        if not keys:
            raise ValueError(f"{path}: no {prefix!r} tensors (a DiT-only weights file?)")
        state = {k[len(prefix):]: f.get_tensor(k) for k in keys}
    missing, unexpected = module.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{path}: {prefix} tensors do not match the model: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")


def load_vae(cfg: ModelConfig, path: Path, device: torch.device | str = "cpu") -> VideoVAE:
    vae = VideoVAE(cfg)
    _load_prefixed(vae, path, VAE_PREFIX)
    return vae.to(device).eval().requires_grad_(False)


def load_audio_encoder(cfg: ModelConfig, path: Path, device: torch.device | str = "cpu") -> AudioEncoder:
    enc = AudioEncoder(cfg)
    _load_prefixed(enc, path, AUDIO_PREFIX)
    return enc.to(device).eval().requires_grad_(False)
