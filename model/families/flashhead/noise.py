"""Gaussian noise for a batch of sessions, each row from its session's own generator.

A session's noise is the same whether its chunk runs alone or in a batch with others: row ``i`` is drawn
from ``generators[i]`` alone, with the shape one session draws, so its stream of draws does not depend on
the batch it was in.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor


def randn_rows(shape: Sequence[int], generators: torch.Generator | Sequence[torch.Generator], dtype: torch.dtype,
               device: torch.device | str) -> Tensor:
    """Standard normal noise of ``shape`` (batch first): from one ``generator`` as one draw, or with one generator
    per row, each row a draw of ``(1, *shape[1:])`` from its own."""
    if isinstance(generators, torch.Generator):
        return torch.randn(tuple(shape), generator=generators, dtype=dtype, device=device)
    if len(generators) != shape[0]:
        raise ValueError(f"{len(generators)} generators for a batch of {shape[0]}")
    row = (1, *shape[1:])
    return torch.cat([torch.randn(row, generator=g, dtype=dtype, device=device) for g in generators])
