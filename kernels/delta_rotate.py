"""Position reset: rotate the temporal RoPE channels of every cached ring key back by ``delta_t``.

Contract (shared with the Triton kernel): ``k_all`` is the whole K storage of a rank,
(n_layers, n_heads, n_slots, head_dim), float8_e4m3fn or bf16/fp32, modified in place in one
launch; ``k_scale`` float32 (n_layers, n_heads); channels ``[0, 2 * len(freqs_t))`` are temporal;
each pair rotates by ``-delta_t * freq`` (position t becomes t - delta_t). Sink slots keep their
fixed position. FP8: dequantize -> rotate -> requantize with the same per-head scale.
``delta_t`` may be negative (a rollback across a reset undoes one). ``skip`` = (first slot, count):
ring slots left as they are -- the frame about to be overwritten, whose keys no one reads again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from charstream.kernels.fp8 import FP8_MAX, dequantize, is_fp8, quantize
from charstream.kernels.rope import rotate_pairs


def delta_rotate_reference(
    k_all: torch.Tensor,
    k_scale: torch.Tensor,
    delta_t: int | torch.Tensor,
    freqs_t: torch.Tensor,
    sink_slots: int,
    skip: tuple[int, int] | None = None,
) -> None:
    d_t = 2 * freqs_t.numel()
    ring_t = k_all[:, :, sink_slots:, :d_t]  # a view: written back in place
    scale = k_scale[:, :, None, None]
    rotated = quantize(rotate_pairs(dequantize(ring_t, scale), -delta_t * freqs_t), scale, k_all.dtype)
    if skip is not None:
        kept = slice(skip[0] - sink_slots, skip[0] - sink_slots + skip[1])
        rotated[:, :, kept] = ring_t[:, :, kept]
    ring_t.copy_(rotated)


# Not specialised on the skipped frame's slot bounds: they move with the frame a reset falls on, and
# Triton keys a compiled variant on whether an integer is 1 or a multiple of 16, so a later reset would
# compile a variant of its own mid-session (every serving process of a machine at the same frame).
@triton.jit(do_not_specialize=["skip_lo", "skip_hi"])
def _delta_rotate_kernel(
    k, stride_kl, stride_kh, stride_ks, k_scale, stride_sl, freqs_t, delta, n_heads, n_slots, sink_slots, skip_lo,
    skip_hi, NT: tl.constexpr, PAIRS: tl.constexpr, BLOCK_S: tl.constexpr,
    DELTA_IN_TENSOR: tl.constexpr, QUANT: tl.constexpr, FP8_MAX: tl.constexpr,
):
    # One program: BLOCK_S ring slots of one (layer, head). Each row's first 2 x PAIRS channels (the
    # temporal ones rounded up to a power of two: 64 bytes of a 128-byte FP8 row, two whole 32-byte
    # sectors) are read and written unmasked in 16-byte vectors; channels past the temporal ones
    # rotate by angle 0 and requantize to themselves exactly (x * s / s is within 2^-23 of an e4m3
    # value, which rounds back to it), so whole sectors are written and no partial-sector store
    # costs a read-modify-write.
    layer = tl.program_id(0) // n_heads
    head = tl.program_id(0) % n_heads
    s = sink_slots + tl.program_id(1) * BLOCK_S + tl.arange(0, BLOCK_S)
    pair = tl.arange(0, PAIRS)
    ch = tl.arange(0, 2 * PAIRS)
    if DELTA_IN_TENSOR:
        dt = tl.load(delta).to(tl.float32)
    else:
        dt = delta
    angle = -dt * tl.load(freqs_t + pair, mask=pair < NT, other=0.0)
    cos = tl.cos(angle)[None, :]
    sin = tl.sin(angle)[None, :]
    mask = ((s < n_slots) & ((s < skip_lo) | (s >= skip_hi)))[:, None]  # masked rows move no bytes
    ptr = k + layer * stride_kl + head * stride_kh + s[:, None] * stride_ks + ch[None, :]
    x = tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    if QUANT:
        scale = tl.load(k_scale + layer * stride_sl + head)
        x = x * scale
    xe, xo = tl.split(tl.reshape(x, (BLOCK_S, PAIRS, 2)))
    x = tl.reshape(tl.join(xe * cos - xo * sin, xe * sin + xo * cos), (BLOCK_S, 2 * PAIRS))
    if QUANT:
        x = tl.clamp(x / scale, -FP8_MAX, FP8_MAX)
    tl.store(ptr, x.to(k.dtype.element_ty), mask=mask)


def delta_rotate_triton(
    k_all: torch.Tensor,
    k_scale: torch.Tensor,
    delta_t: int | torch.Tensor,
    freqs_t: torch.Tensor,
    sink_slots: int,
    skip: tuple[int, int] | None = None,
    block_s: int = 128,
    num_warps: int = 4,
) -> None:
    """The position reset over every layer and head in one launch, in place."""
    n_layers, n_heads, n_slots, head_dim = k_all.shape
    if k_all.stride(-1) != 1 or k_scale.stride(-1) != 1:
        raise ValueError("k_all needs a contiguous head_dim and k_scale a contiguous head axis")
    n_pairs = freqs_t.numel()
    pairs = triton.next_power_of_2(n_pairs)
    if 2 * pairs > head_dim or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim {head_dim} must be a power of two holding the {2 * n_pairs} temporal channels")
    grid = (n_layers * n_heads, triton.cdiv(n_slots - sink_slots, block_s))
    _delta_rotate_kernel[grid](
        k_all, k_all.stride(0), k_all.stride(1), k_all.stride(2), k_scale, k_scale.stride(0),
        freqs_t, delta_t if isinstance(delta_t, torch.Tensor) else float(delta_t), n_heads, n_slots, sink_slots,
        *((skip[0], skip[0] + skip[1]) if skip is not None else (0, 0)), NT=n_pairs, PAIRS=pairs, BLOCK_S=block_s,
        DELTA_IN_TENSOR=isinstance(delta_t, torch.Tensor), QUANT=is_fp8(k_all), FP8_MAX=FP8_MAX,
        num_warps=num_warps,
    )


def delta_rotate(
    k_all: torch.Tensor,
    k_scale: torch.Tensor,
    delta_t: int | torch.Tensor,
    freqs_t: torch.Tensor,
    sink_slots: int,
    skip: tuple[int, int] | None = None,
) -> None:
    """Dispatcher: the Triton kernel on CUDA, the PyTorch reference otherwise."""
    rotate = delta_rotate_triton if k_all.is_cuda else delta_rotate_reference
    rotate(k_all, k_scale, delta_t, freqs_t, sink_slots, skip)
