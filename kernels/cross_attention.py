"""A block's cross-attention: every token's cross-query over the step's few audio keys, one launch.

``cross_attention(q, k, v, out)``: q (T, H, D) -- the (tokens, heads) columns of the fused
projection, any token and head strides, D contiguous -- attends per head over k, v (H, A, D) (any head and
key strides, D contiguous; A a handful of audio keys, at most ``MAX_KEYS``) with softmax scale
1/sqrt(D); the result is written into ``out`` (T, H, D), which may be q itself (a tile's queries are read
before its output is written, by the one program that owns the tile). fp32 scores and softmax, the
probabilities rounded to q's dtype for their product with v, fp32 accumulation.

The Triton kernel: one program per (128-query block, head) tile, the keys and values one block in
registers; 0.5 us a call faster than the ring kernel's sink-only form, which it replaced (docs/PERF.md, Kernels).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

MAX_KEYS = 64  # the keys are one block in registers
BLOCK_M = 128


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> None:
    t, h, d = q.shape
    if k.shape != v.shape or k.dim() != 3 or k.shape[0] != h or k.shape[2] != d or out.shape != q.shape:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, out {tuple(out.shape)}: "
                         "need q and out (T, H, D), k and v (H, A, D)")
    if not 1 <= k.shape[1] <= MAX_KEYS:
        raise ValueError(f"cross-attention over 1..{MAX_KEYS} keys, got {k.shape[1]}")
    if any(x.stride(-1) != 1 for x in (q, k, v, out)):
        raise ValueError("q, k, v and out need a contiguous last dimension")


def cross_attention_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    _check(q, k, v, out)
    scores = torch.einsum("thd,had->hta", q.float(), k.float()) / math.sqrt(q.shape[-1])
    out.copy_(torch.einsum("hta,had->thd", scores.softmax(-1), v.float()))
    return out


@triton.jit
def _cross_attention_kernel(
    q, stride_qt, stride_qh, k, stride_kh, stride_ka, v, stride_vh, stride_va, out, stride_ot, stride_oh,
    n_tokens, n_keys, qk_scale,
    BLOCK_M: tl.constexpr, KEYS: tl.constexpr, D: tl.constexpr,
):
    # qk_scale = log2(e) / sqrt(D): the softmax in exp2. Heads on the grid's fast axis, so programs that
    # run at once read different heads' keys and values (each 2 x KEYS x D, from L2 after the first).
    head = tl.program_id(0)
    rows = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, D)
    a = tl.arange(0, KEYS)
    rmask = (rows < n_tokens)[:, None]
    kmask = (a < n_keys)[:, None]
    qt = tl.load(q + rows[:, None] * stride_qt + head * stride_qh + d[None, :], mask=rmask, other=0.0)
    kt = tl.load(k + head * stride_kh + a[:, None] * stride_ka + d[None, :], mask=kmask, other=0.0)
    vt = tl.load(v + head * stride_vh + a[:, None] * stride_va + d[None, :], mask=kmask, other=0.0)
    s = tl.dot(qt, tl.trans(kt)) * qk_scale
    s = tl.where((a < n_keys)[None, :], s, float("-inf"))
    p = tl.exp2(s - tl.max(s, 1)[:, None])
    o = tl.dot(p.to(vt.dtype), vt) * (1.0 / tl.sum(p, 1))[:, None]
    tl.store(out + rows[:, None] * stride_ot + head * stride_oh + d[None, :], o.to(out.dtype.element_ty), mask=rmask)


def cross_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                           num_warps: int = 8) -> torch.Tensor:
    """One launch, one program per (query block, head) tile."""
    _check(q, k, v, out)
    t, h, d = q.shape
    _cross_attention_kernel[(h, triton.cdiv(t, BLOCK_M))](
        q, q.stride(0), q.stride(1), k, k.stride(0), k.stride(1), v, v.stride(0), v.stride(1),
        out, out.stride(0), out.stride(1), t, k.shape[1], math.log2(math.e) / math.sqrt(d),
        BLOCK_M=BLOCK_M, KEYS=max(16, triton.next_power_of_2(k.shape[1])), D=d, num_warps=num_warps,
    )
    return out


def cross_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Dispatcher: the Triton kernel on CUDA, the PyTorch reference otherwise."""
    if q.is_cuda:
        return cross_attention_triton(q, k, v, out)
    return cross_attention_reference(q, k, v, out)
