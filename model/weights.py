"""Weights on disk: one safetensors file holding the full (unsharded) model.

Each TP rank reads only its own slices (safetensors ``get_slice`` maps the file, so a rank of
``characters-57b`` never materialises the other ranks' parameters). ``build_model`` constructs the
module on the meta device, shards it, then allocates just the shard on the target device.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file

from model.config import ModelConfig
from model.dit import DiT
from model.tp import apply_tp, shard_ranges

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
