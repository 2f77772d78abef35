"""3-D rotary position embedding (time, height, width), interleaved pairs, theta 10,000.

Per head, channels ``[0, d_t)`` carry time, then ``[d_t, d_t + d_h)`` height, then width, with
``d_h = d_w = 2 * (head_dim // 6)`` and ``d_t = head_dim - 2 * d_h`` (16 -> 8/4/4, 128 -> 44/42/42).
Pairs ``(x[2i], x[2i+1])`` rotate as complex numbers by ``position * theta^(-2i / d_group)``.
Keys are rotated once, when written into the cache; queries on every pass. The per-step paths use
one complex multiply per tensor (`complex_rotation` tables, `rotate_complex`); `rotate` is the real form.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

THETA = 10_000.0


class RopeFreqs(NamedTuple):
    """Per-group frequency vectors (float32): lengths d_t/2, d_h/2, d_w/2."""

    t: torch.Tensor
    h: torch.Tensor
    w: torch.Tensor


def rope_split(head_dim: int) -> tuple[int, int, int]:
    """Channel widths (d_t, d_h, d_w) of the three position groups."""
    d_h = 2 * (head_dim // 6)
    d_t = head_dim - 2 * d_h
    if head_dim % 2 or d_h == 0 or d_t <= 0:
        raise ValueError(f"head_dim {head_dim} cannot hold 3-D RoPE (needs an even head_dim >= 6)")
    return d_t, d_h, d_h


def _group_freqs(d_group: int, theta: float) -> torch.Tensor:
    return theta ** (-torch.arange(0, d_group, 2, dtype=torch.float64) / d_group)


def rope_freqs(head_dim: int, device: torch.device | str = "cpu", theta: float = THETA) -> RopeFreqs:
    d_t, d_h, d_w = rope_split(head_dim)
    return RopeFreqs(*(_group_freqs(d, theta).to(device=device, dtype=torch.float32) for d in (d_t, d_h, d_w)))


def rope_angles(positions: torch.Tensor, freqs: RopeFreqs) -> torch.Tensor:
    """Angles (T, head_dim // 2) for integer positions (T, 3) = (t, h, w)."""
    p = positions.to(torch.float32)
    return torch.cat(
        [p[:, 0:1] * freqs.t[None], p[:, 1:2] * freqs.h[None], p[:, 2:3] * freqs.w[None]], dim=-1
    )


def rotation_tables(angles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, signed_sin), each (..., 2 * n), for ``angles`` (..., n): cos repeated over each pair,
    sin as (-sin, +sin), so a rotation is two products and a sum (``rotate``)."""
    cos, sin = angles.cos(), angles.sin()
    return cos.repeat_interleave(2, dim=-1), torch.stack([-sin, sin], dim=-1).flatten(-2)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of ``x`` (..., 2 * n) by tables from ``rotation_tables`` broadcastable to
    x's shape. fp32 math, fp32 result; bit-identical to (x0 cos - x1 sin, x0 sin + x1 cos) in fewer ops."""
    xf = x.float()
    swapped = xf.unflatten(-1, (-1, 2)).flip(-1).flatten(-2)  # (x1, x0) per pair
    return xf * cos + swapped * signed_sin


def complex_rotation(rotation: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``rope_rotation``'s (cos, signed_sin) tables (..., 2n) as one complex64 table cos + i sin (..., n)."""
    cos, signed_sin = rotation
    return torch.complex(cos[..., 0::2].float(), signed_sin[..., 1::2].float())


def rotate_complex(x: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
    """``rotate(x, cos, signed_sin)`` with the tables as ``complex_rotation(...)``: each interleaved pair
    (x0, x1) times cos + i sin, i.e. (x0 cos - x1 sin, x0 sin + x1 cos), the same products and sums in
    one op instead of a flip and three arithmetic passes. fp32 result."""
    pairs = x.float().unflatten(-1, (-1, 2))
    if pairs.storage_offset() % 2 or any(st % 2 for st in pairs.stride()[:-2]) or pairs.stride(-1) != 1:
        pairs = pairs.contiguous()  # view_as_complex needs whole complex elements
    return torch.view_as_real(torch.view_as_complex(pairs) * table).flatten(-2)


def rotate_pairs(x: torch.Tensor, angles: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs of ``x`` (..., 2 * n) by ``angles`` broadcastable to (..., n). fp32 math."""
    return rotate(x, *rotation_tables(angles))


def rope_rotation(positions: torch.Tensor, freqs: RopeFreqs) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotation tables (cos, signed_sin), each (T, 1, head_dim), for tokens at ``positions`` (T, 3):
    compute once, rotate many tensors (every layer's queries and keys of a frame)."""
    return rotation_tables(rope_angles(positions, freqs)[:, None, :])  # broadcast over heads


def apply_rope(x: torch.Tensor, positions: torch.Tensor, freqs: RopeFreqs) -> torch.Tensor:
    """RoPE on ``x`` (..., T, n_heads, head_dim) at ``positions`` (T, 3); returns x's dtype."""
    return rotate(x, *rope_rotation(positions, freqs)).to(x.dtype)
