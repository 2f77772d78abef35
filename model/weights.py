"""Weights on disk: one safetensors file holding the full (unsharded) model.

Each TP rank reads only its own slices (safetensors ``get_slice`` maps the file, so a rank of
``characters-57b`` never materialises the other ranks' parameters). ``build_model`` constructs the
module on the meta device, shards it, then allocates just the shard on the target device.

The trained ``tiny`` character is one file (model/assets/tiny.safetensors): the DiT's tensors under
their own names (what ``load_weights`` reads; it ignores other keys), the VAE's under ``vae.``, the
audio encoder's under ``audio_encoder.``. A training run writes the DiT and the rest as two files
(``save_parts``: each fits the 16 MB limit of a file coming back from the GPU machine); ``merge``
joins them into the shipped file.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from charstream.model.audio_encoder import AudioEncoder
from charstream.model.config import ModelConfig, get_preset
from charstream.model.dit import DiT
from charstream.model.tp import apply_tp, shard_ranges
from charstream.model.vae import Decoder, VideoVAE

VAE_PREFIX = "vae."
DECODER_PREFIX = VAE_PREFIX + "decoder."  # the decoder alone, as the decode stage loads it
AUDIO_PREFIX = "audio_encoder."
ASSETS = Path(__file__).parent / "assets"  # packaged weights: assets/<preset>.safetensors


def packaged_weights(preset: str) -> Path | None:
    """The weights shipped with the package for ``preset`` (the trained ``tiny``), if present."""
    path = ASSETS / f"{preset}.safetensors"
    return path if path.exists() else None


def save_weights(model: DiT, path: str | Path) -> None:
    if model.tp_world != 1:
        raise ValueError("save_weights takes the full model (TP world 1); each rank holds only a shard")
    tensors = {name: t.detach().contiguous().cpu() for name, t in model.state_dict().items()}
    save_file(tensors, str(path), metadata={"preset": model.cfg.name})


@torch.no_grad()
def load_weights(model: DiT, path: str | Path) -> DiT:
    """Copy this rank's slices of every parameter from ``path`` into ``model`` (already sharded)."""
    cfg = model.cfg
    with safe_open(str(path), framework="pt", device="cpu") as f:
        stored = set(f.keys())
        expected = dict(model.state_dict())
        missing = sorted(set(expected) - stored)
        if missing:
            raise ValueError(f"{path}: weights lack {len(missing)} tensors (first: {missing[:3]}) for preset {cfg.name!r}")
        for name, target in expected.items():
            spec = shard_ranges(name, cfg, model.tp_rank, model.tp_world)
            if spec is None:
                tensor = f.get_tensor(name)
            else:
                axis, ranges = spec
                view = f.get_slice(name)
                parts = [view[start:stop] if axis == 0 else view[:, start:stop] for start, stop in ranges]
                tensor = torch.cat(parts, dim=axis)
            if tensor.shape != target.shape:
                raise ValueError(f"{path}: {name} has shape {tuple(tensor.shape)}, the model wants {tuple(target.shape)}")
            target.copy_(tensor)
    return model


def build_model(
    cfg: ModelConfig,
    weights: str | Path | None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    tp_group: dist.ProcessGroup | None = None,
    seed: int = 0,
) -> DiT:
    """This rank's shard of the DiT on ``device``: loaded from ``weights`` or random (``seed``).

    Random weights are drawn per shard, so they equal across TP sizes only through a weights file.
    """
    world = dist.get_world_size(tp_group) if tp_group is not None else 1
    rank = dist.get_rank(tp_group) if tp_group is not None else 0
    cfg.validate(world)
    with torch.device("meta"):
        model = DiT(cfg).to(dtype)
    apply_tp(model, rank, world, tp_group)
    model.to_empty(device=device)
    if weights is None:
        model.init_random_(seed + rank, tp_world=world)
    else:
        load_weights(model, weights)
    return model.eval().requires_grad_(False)


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


def resolve_weights(preset: str, weights: str | None) -> str | None:
    """``weights`` as a file: ``"packaged"`` is the shipped file when present; None means random weights."""
    path = packaged_weights(preset) if weights == "packaged" else weights
    return str(path) if path else None


def load_decoder(preset: str, path: str | None, device: str, dtype: torch.dtype | str, seed: int = 0) -> Decoder:
    """The preset's decoder with the VAE decoder weights of ``path``, or seeded random weights."""
    cfg = get_preset(preset)
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        decoder = Decoder(cfg)
    if path:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            state = {k.removeprefix(DECODER_PREFIX): f.get_tensor(k) for k in f.keys() if k.startswith(DECODER_PREFIX)}
        if not state:
            raise ValueError(f"{path}: no {DECODER_PREFIX!r} tensors: not a weights file with a VAE")
        decoder.load_state_dict(state, strict=True)
    return decoder.to(device=device, dtype=dtype).eval().requires_grad_(False)
