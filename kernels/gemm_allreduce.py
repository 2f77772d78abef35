"""Row-parallel output projection and its all-reduce (the one collective per block).

``gemm_all_reduce_reference``: the whole GEMM, then one all-reduce -- what every step runs. (Row tiles
each handed to an asynchronous all-reduce measured slower on 2 x H200; a persistent FP8 GEMM + all-reduce
over CUDA IPC buffers ran its GEMM at 65% of cuBLAS's rate and served nowhere: both are gone, docs/PERF.md.)
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
