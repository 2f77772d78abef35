"""Row-parallel output projection fused with its all-reduce (the one collective per block).

``gemm_all_reduce_reference``: the whole GEMM, then one all-reduce. ``GemmAllReduce``: the rows in
tiles; each tile's partial product is handed to an asynchronous all-reduce as soon as it exists,
while the next tile's GEMM runs. NCCL runs collectives on its own stream and gloo on its own thread,
so the reduction of tile i overlaps the GEMM of tile i+1 and only the last tile's reduction is
exposed. The output buffer is allocated once, for the steady-state row count only (757 tokens for
``characters-57b``); any other shape -- the first passes of a session, training -- takes the
reference path. ``nbytes`` reports the memory it holds, and the whole path is a config switch
(``DiffusionConfig.fused_gemm_allreduce``): the reference system had to turn its fused kernel off
when an upgrade ran workers out of memory.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

Linear = Callable[[torch.Tensor], torch.Tensor]


def gemm_all_reduce_reference(x: torch.Tensor, linear: Linear, group: dist.ProcessGroup | None) -> torch.Tensor:
    """``linear(x)`` summed over the TP group: the plain GEMM-then-collective path."""
    out = linear(x)
    dist.all_reduce(out, group=group)
    return out


class GemmAllReduce:
    """Tiled GEMM + all-reduce with overlap, for inputs of exactly ``rows`` rows (after flattening)."""

    def __init__(
        self,
        rows: int,
        out_features: int,
        dtype: torch.dtype,
        device: torch.device | str,
        group: dist.ProcessGroup | None,
        tiles: int = 4,
    ) -> None:
        if not 1 <= tiles <= rows:
            raise ValueError(f"tiles must be in [1, rows={rows}], got {tiles}")
        self.rows, self.group = rows, group
        self.out = torch.empty(rows, out_features, dtype=dtype, device=device)
        bounds = torch.linspace(0, rows, tiles + 1).round().long().tolist()
        self.tiles = list(zip(bounds[:-1], bounds[1:], strict=True))

    @property
    def nbytes(self) -> int:
        return self.out.numel() * self.out.element_size()

    def applies_to(self, x: torch.Tensor) -> bool:
        return x.numel() // x.shape[-1] == self.rows and x.dtype == self.out.dtype

    def __call__(self, x: torch.Tensor, linear: Linear) -> torch.Tensor:
        """``linear(x)`` all-reduced, as a view of the internal buffer: consume it before the next call
        (a block adds it to its residual at once)."""
        if not self.applies_to(x):
            return gemm_all_reduce_reference(x, linear, self.group)
        flat = x.reshape(self.rows, x.shape[-1])
        pending = []
        for start, stop in self.tiles:
            self.out[start:stop] = linear(flat[start:stop])
            pending.append(dist.all_reduce(self.out[start:stop], group=self.group, async_op=True))
        for work in pending:
            work.wait()
        return self.out.reshape(*x.shape[:-1], self.out.shape[-1])
