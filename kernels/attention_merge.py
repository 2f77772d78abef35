"""Merge of attention outputs computed over S disjoint partitions of the keys (a split window), by
each partition's softmax log-sum-exp.

Contract (shared by the reference and the Triton kernel, checked by ``_check_merge_args``):
``parts`` (S, T, H, D) float8_e4m3fn codes, contiguous: partition p's output for token t, head h is
``parts[p, t, h, :] * head_scale[h]``; ``lse`` (S, H, T) float32, contiguous: the natural-log
log-sum-exp of partition p's (already scaled) scores for (h, t), i.e. cuDNN's softmax "Stats"
(max + log(sum exp(s - max))); ``head_scale`` (H,) float32. ``out`` (T, H, D) bfloat16, written in
place, may be a view into a wider buffer: ``out.stride(2) == 1``, ``out.stride(1) == D``, any row
stride (rows not overlapping); nothing outside the view is written. D a power of two, S >= 1.

With ``m = max_p lse[p, h, t]`` and ``w_p = exp(lse[p, h, t] - m)``:
``out[t, h, :] = head_scale[h] * sum_p w_p * parts[p, t, h, :] / sum_p w_p``, in fp32, stored as bf16.
Each (h, t) needs at least one finite lse (an all -inf column, no keys at all, gives NaN, as the
softmax over no keys would).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from charstream.kernels.fp8 import FP8_DTYPE


def _check_merge_args(parts: torch.Tensor, lse: torch.Tensor, head_scale: torch.Tensor,
                      out: torch.Tensor) -> tuple[int, int, int, int]:
    """The contract above, for both paths (the reference accepts what the kernel accepts); returns
    (S, T, H, D)."""
    if parts.dtype != FP8_DTYPE or parts.dim() != 4 or not parts.is_contiguous():
        raise ValueError(f"parts must be contiguous (S, T, H, D) float8_e4m3fn codes, got {parts.dtype} "
                         f"{tuple(parts.shape)} strides {parts.stride()}")
    s, t, h, d = parts.shape
    if s < 1:
        raise ValueError("parts needs at least one partition (S >= 1)")
    if h < 1 or d < 1 or d & (d - 1):  # the kernel holds a (heads, D) block: D is a block dimension
        raise ValueError(f"head_dim D must be a power of two (and H >= 1), got H={h}, D={d}")
    if lse.dtype != torch.float32 or lse.shape != (s, h, t) or not lse.is_contiguous():
        raise ValueError(f"lse must be contiguous ({s}, {h}, {t}) float32 (S, H, T), got {lse.dtype} "
                         f"{tuple(lse.shape)} strides {lse.stride()}")
    if head_scale.dtype != torch.float32 or head_scale.shape != (h,) or head_scale.stride(0) != 1:
        raise ValueError(f"head_scale must be ({h},) float32 with unit stride, got {head_scale.dtype} "
                         f"{tuple(head_scale.shape)}")
    if out.dtype != torch.bfloat16 or out.shape != (t, h, d):
        raise ValueError(f"out must be ({t}, {h}, {d}) bfloat16, got {out.dtype} {tuple(out.shape)}")
    # rows of H x D contiguous values at any row stride: a column slice of a wider (T, ...) buffer
    if out.stride(2) != 1 or out.stride(1) != d or (t > 1 and out.stride(0) < h * d):
        raise ValueError(f"out needs strides (>= {h * d}, {d}, 1) (contiguous non-overlapping rows), "
                         f"got {out.stride()}")
    devices = {parts.device, lse.device, head_scale.device, out.device}
    if len(devices) != 1:
        raise ValueError(f"parts, lse, head_scale and out must share a device, got {devices}")
    return s, t, h, d


def merge_partials_reference(parts: torch.Tensor, lse: torch.Tensor, head_scale: torch.Tensor,
                             out: torch.Tensor) -> torch.Tensor:
    _check_merge_args(parts, lse, head_scale, out)
    w = torch.exp(lse - lse.amax(0, keepdim=True)).transpose(1, 2)  # (S, T, H): the largest weight is 1
    num = (w[..., None] * parts.float()).sum(0)  # (T, H, D)
    out.copy_(num * (head_scale[None, :, None] / w.sum(0)[..., None]))
    return out


@triton.jit
def _merge_partials_kernel(
    parts, lse, head_scale, out, stride_ot, n_tokens, n_heads,
    S: tl.constexpr, H_P2: tl.constexpr, D: tl.constexpr,
):
    # One program per token: all its heads as one (H_P2, D) block, so parts' (H, D) rows are one
    # contiguous H x D span per partition (wide vector loads) and the per-head work (weights, the
    # normaliser, the scale) stays (H_P2,) vectors broadcast over D. S is small and compile-time: the
    # loops unroll and every partition's loads can be in flight at once.
    t = tl.program_id(0)
    h = tl.arange(0, H_P2)
    d = tl.arange(0, D)
    hmask = h < n_heads
    mask = hmask[:, None] & (d < D)[None, :]
    hd = h[:, None] * D + d[None, :]
    # pass 1: the max over partitions; pass 2 re-reads lse (S x H floats per token, just loaded)
    m = tl.full((H_P2,), float("-inf"), tl.float32)
    for p in tl.static_range(S):
        m = tl.maximum(m, tl.load(lse + (p * n_heads + h) * n_tokens + t, mask=hmask, other=float("-inf")))
    m = tl.where(hmask, m, 0.0)  # padded heads: exp(-inf - 0) = 0 below, not exp(-inf + inf) = NaN
    acc = tl.zeros((H_P2, D), tl.float32)
    den = tl.zeros((H_P2,), tl.float32)
    for p in tl.static_range(S):
        w = tl.exp(tl.load(lse + (p * n_heads + h) * n_tokens + t, mask=hmask, other=float("-inf")) - m)
        den += w
        x = tl.load(parts + (p * n_tokens + t) * (n_heads * D) + hd, mask=mask, other=0.0).to(tl.float32)
        acc += w[:, None] * x
    # the scale and the normaliser folded per head: one multiply per element, no division; padded
    # heads divide 0 by 1, not by their 0 sum (stored nowhere, but a 0 / 0 is a NaN all the same)
    factor = tl.load(head_scale + h, mask=hmask, other=0.0) / tl.where(hmask, den, 1.0)
    tl.store(out + t * stride_ot + hd, (acc * factor[:, None]).to(out.dtype.element_ty), mask=mask)


def merge_partials_triton(parts: torch.Tensor, lse: torch.Tensor, head_scale: torch.Tensor, out: torch.Tensor,
                          num_warps: int = 4) -> torch.Tensor:
    """One launch, one program per token."""
    s, t, h, d = _check_merge_args(parts, lse, head_scale, out)
    if t == 0:  # an empty grid is not a launch
        return out
    _merge_partials_kernel[(t,)](
        parts, lse, head_scale, out, out.stride(0), t, h,
        S=s, H_P2=triton.next_power_of_2(h), D=d, num_warps=num_warps,
    )
    return out


def merge_partials(parts: torch.Tensor, lse: torch.Tensor, head_scale: torch.Tensor,
                   out: torch.Tensor) -> torch.Tensor:
    """Dispatcher: the Triton kernel on CUDA, the PyTorch reference otherwise."""
    fn = merge_partials_triton if parts.is_cuda else merge_partials_reference
    return fn(parts, lse, head_scale, out)
