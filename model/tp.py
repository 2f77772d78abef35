"""Tensor parallelism as a small transform over the plain DiT (as gpt-fast does).

Per block, ``w_in`` (fused [q | k | v | cross-q | mlp-up]) and ``w_cross_kv`` are split by output
columns -- each rank keeps its heads of every attention segment and its slice of the MLP -- and
``w_out`` by input rows in the same order, so a rank's partial output is summed by ONE all-reduce
per block (a forward hook on ``w_out``). Embeddings, adaLN and the head are replicated: they are
tiny next to the blocks. ``shard_ranges`` is the single description of the split; the weights
loader uses it to read only a rank's slices from disk.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from charstream.model.config import ModelConfig
from charstream.model.dit import DiT


def _segments(sizes: list[int], rank: int, world: int) -> list[tuple[int, int]]:
    """This rank's [start, stop) within each of the concatenated segments."""
    ranges, offset = [], 0
    for size in sizes:
        part = size // world
        ranges.append((offset + rank * part, offset + (rank + 1) * part))
        offset += size
    return ranges


def shard_ranges(name: str, cfg: ModelConfig, rank: int, world: int) -> tuple[int, list[tuple[int, int]]] | None:
    """(axis, ranges to concatenate) of parameter ``name`` held by ``rank``; None if replicated."""
    hd = cfg.n_heads * cfg.head_dim
    if name.endswith("w_in.weight"):
        return 0, _segments([hd, hd, hd, hd, cfg.ffn_dim], rank, world)
    if name.endswith("w_cross_kv.weight"):
        return 0, _segments([hd, hd], rank, world)
    if name.endswith("w_out.weight"):
        return 1, _segments([hd, hd, cfg.ffn_dim], rank, world)
    return None


def take_shard(full: torch.Tensor, axis: int, ranges: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([full.narrow(axis, start, stop - start) for start, stop in ranges], dim=axis)


def apply_tp(model: DiT, rank: int, world: int, group: dist.ProcessGroup | None = None) -> DiT:
    """Shard ``model`` in place for ``rank`` of ``world`` (works on meta tensors too)."""
    cfg = model.cfg
    cfg.validate(world)
    if world == 1:
        return model
    for name, module in model.named_modules():
        for pname, param in list(module.named_parameters(recurse=False)):
            spec = shard_ranges(f"{name}.{pname}", cfg, rank, world)
            if spec is not None:
                setattr(module, pname, nn.Parameter(take_shard(param.data, *spec), requires_grad=param.requires_grad))
                module.out_features, module.in_features = module.weight.shape
    for block in model.blocks:
        block.n_heads //= world
        block.ffn_dim //= world
        block.all_reduce_hook = block.w_out.register_forward_hook(_all_reduce_hook(group))
    model.tp_rank, model.tp_world, model.tp_group = rank, world, group
    return model


def _all_reduce_hook(group: dist.ProcessGroup | None):
    def hook(_module: nn.Module, _inputs: tuple, partial: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(partial, group=group)  # the block's one collective
        return partial

    return hook
