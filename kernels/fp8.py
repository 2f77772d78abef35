"""FP8 e4m3 storage helpers shared by the cache kernels' references.

Dequantized value = stored fp8 x per-head scale. Quantization clamps to +-448 (e4m3's largest
finite value) instead of producing NaN: a value beyond the scale's range saturates.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype == FP8_DTYPE


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as a same-width integer tensor: index_copy_ / index_put_ / index_select through this
    view work for FP8 on every backend (FP8 has no index ops everywhere), with the index on the device."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Store ``x`` in ``dtype``: FP8 with ``scale`` (broadcastable to x), or a plain cast."""
    if dtype != FP8_DTYPE:
        return x.to(dtype)
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize(stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values of ``stored`` in ``dtype``: FP8 times ``scale`` (broadcastable), or a plain cast."""
    if not is_fp8(stored):
        return stored.to(dtype)
    return (stored.float() * scale).to(dtype)
