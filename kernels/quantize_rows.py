"""Per-row FP8 quantization of activations (the A operand of the FP8 weight GEMMs), with an
optional GELU on a tail of columns -- the MLP half of a parallel block's output-projection input --
fused into the same pass.

``quantize_rows(x, act_from)``: x (M, K) bf16/fp32 -> (xq (M, K) float8_e4m3fn, scale (M, 1) float32)
with ``x' = x`` on columns ``[0, act_from)`` and ``gelu_tanh(x)`` on ``[act_from, K)`` (``act_from = K``:
no activation), ``scale = max(amax(|x'|), tiny) / 448`` and ``xq = x' / scale``. Dequantized = xq x scale.
``prefix`` (M, P), optional: the rows' first P columns, read from there instead of from x (whose
columns [0, P) are then not read) -- a producer's own output buffer (cuDNN's attention output) needs no
copy into x first. ``prefix_scale`` (G,) float32, optional: the prefix's values are its entries times
the scale of their group of P / G columns (an FP8 prefix: e4m3 codes with a scale per head).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from charstream.kernels.fp8 import FP8_DTYPE, FP8_MAX

MIN_AMAX = 1e-12  # an all-zero row gets a tiny scale instead of a division by zero


def quantize_rows_reference(x: torch.Tensor, act_from: int | None = None, prefix: torch.Tensor | None = None,
                            prefix_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    k = x.shape[-1]
    act_from = k if act_from is None else act_from
    if prefix is None:
        xf = x.float()
    else:
        lead = prefix.float()
        if prefix_scale is not None:
            lead = lead * prefix_scale.repeat_interleave(prefix.shape[1] // prefix_scale.numel())
        xf = torch.cat([lead, x[:, prefix.shape[1] :].float()], dim=1)
    if act_from < k:
        xf = torch.cat([xf[:, :act_from], F.gelu(xf[:, act_from:], approximate="tanh")], dim=1)
    scale = xf.abs().amax(dim=1, keepdim=True).clamp_min(MIN_AMAX) / FP8_MAX
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


# 0.5 x (1 + tanh(u)) = x * sigmoid(2u), u = sqrt(2/pi) (x + 0.044715 x^3): x / (1 + 2^(x (K1 + K2 x^2)))
# with the constants folded into one exp2: 5 multiplies and a compare an element fewer than tl.exp of
# the unfolded form, and the GELU was 2/3 of the kernel's instructions (14.0 -> 10.6 us a call on an H200)
_GELU_K1 = tl.constexpr(-2.0 * math.sqrt(2.0 / math.pi) * math.log2(math.e))
_GELU_K2 = tl.constexpr(0.044715 * _GELU_K1.value)


@triton.jit
def _gelu_tanh(x):
    return x / (1.0 + tl.exp2(x * (_GELU_K1 + _GELU_K2 * (x * x))))


@triton.jit
def _load_row(x, stride_xm, prefix, stride_pm, n_prefix, prefix_scale, row, c, n_cols, PREFIX: tl.constexpr,
              PREFIX_SELECT: tl.constexpr, PREFIX_SCALED: tl.constexpr, GROUP: tl.constexpr):
    # PREFIX: columns [0, n_prefix) from prefix, the rest from x, each element read from one of them
    # through one load of per-element pointers (n_prefix a multiple of 16 keeps it 16-byte vectors, as
    # x's own load); PREFIX_SELECT instead: both loaded, the values selected (more instructions: the
    # variant timed against it; the one load of another dtype, an FP8 prefix, needs). PREFIX_SCALED:
    # the prefix's values times their column group's scale (GROUP columns each, a compile-time power of
    # two: the group index is a shift and a sign fix-up, not an integer division per element)
    if PREFIX and not PREFIX_SELECT:
        ptr = tl.where(c < n_prefix, prefix + row * stride_pm + c, x + row * stride_xm + c)
        v = tl.load(ptr, mask=c < n_cols, other=0.0).to(tl.float32)
    elif PREFIX:
        v = tl.load(x + row * stride_xm + c, mask=(c >= n_prefix) & (c < n_cols), other=0.0).to(tl.float32)
        lead = tl.load(prefix + row * stride_pm + c, mask=c < n_prefix, other=0.0).to(tl.float32)
        if PREFIX_SCALED:
            lead = lead * tl.load(prefix_scale + c // GROUP, mask=c < n_prefix, other=1.0)
        v = tl.where(c < n_prefix, lead, v)
    else:
        v = tl.load(x + row * stride_xm + c, mask=c < n_cols, other=0.0).to(tl.float32)
    return v


@triton.jit
def _quantize_rows_kernel(
    x, stride_xm, prefix, stride_pm, n_prefix, prefix_scale, xq, stride_qm, scale_out, n_cols, act_from,
    BLOCK: tl.constexpr, ONE_SWEEP: tl.constexpr, FP8_MAX: tl.constexpr, MIN_AMAX: tl.constexpr,
    PREFIX: tl.constexpr, PREFIX_SELECT: tl.constexpr, PREFIX_SCALED: tl.constexpr, GROUP: tl.constexpr,
):
    # One program per row. ONE_SWEEP (the row fits in BLOCK): the row stays in registers between the
    # amax and the store, so x is read once; otherwise two sweeps (the second reads from L2). The codes:
    # times the reciprocal scale (one multiply, not a division per element), no clamp: |v| <= amax,
    # so |v| / scale <= 448 up to rounding, which the saturating FP8 conversion absorbs (the kernel's
    # time follows its instruction count).
    row = tl.program_id(0)
    if ONE_SWEEP:
        c = tl.arange(0, BLOCK)
        v = _load_row(x, stride_xm, prefix, stride_pm, n_prefix, prefix_scale, row, c, n_cols, PREFIX,
                      PREFIX_SELECT, PREFIX_SCALED, GROUP)
        v = tl.where(c >= act_from, _gelu_tanh(v), v)
        scale = tl.maximum(tl.max(tl.abs(v), 0), MIN_AMAX) / FP8_MAX
        tl.store(scale_out + row, scale)
        tl.store(xq + row * stride_qm + c, (v * (1.0 / scale)).to(xq.dtype.element_ty), mask=c < n_cols)
    else:
        amax = tl.zeros((BLOCK,), tl.float32)
        for start in range(0, n_cols, BLOCK):
            c = start + tl.arange(0, BLOCK)
            v = _load_row(x, stride_xm, prefix, stride_pm, n_prefix, prefix_scale, row, c, n_cols, PREFIX,
                          PREFIX_SELECT, PREFIX_SCALED, GROUP)
            v = tl.where(c >= act_from, _gelu_tanh(v), v)
            amax = tl.maximum(amax, tl.abs(v))
        scale = tl.maximum(tl.max(amax, 0), MIN_AMAX) / FP8_MAX
        tl.store(scale_out + row, scale)
        for start in range(0, n_cols, BLOCK):
            c = start + tl.arange(0, BLOCK)
            v = _load_row(x, stride_xm, prefix, stride_pm, n_prefix, prefix_scale, row, c, n_cols, PREFIX,
                          PREFIX_SELECT, PREFIX_SCALED, GROUP)
            v = tl.where(c >= act_from, _gelu_tanh(v), v)
            tl.store(xq + row * stride_qm + c, (v * (1.0 / scale)).to(xq.dtype.element_ty), mask=c < n_cols)


ONE_SWEEP_MAX_COLS = 16384  # a whole row in registers: 64 fp32 per thread at 8 warps


def quantize_rows_triton(
    x: torch.Tensor,
    act_from: int | None = None,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    num_warps: int = 8,
    prefix: torch.Tensor | None = None,
    prefix_select: bool = False,
    prefix_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One launch. ``out`` = preallocated (xq, scale), so a CUDA graph reuses the same buffers.
    ``prefix_select``: load x's and the prefix's columns both and select the values (the variant the
    per-element pointers replace), so kernels_check times one against the other; a prefix of another
    dtype than x's (FP8, with its ``prefix_scale``) is always loaded so."""
    m, k = x.shape
    if x.stride(1) != 1:
        raise ValueError("x needs contiguous rows")
    if prefix is not None and (prefix.dim() != 2 or prefix.shape[0] != m or prefix.shape[1] > k or prefix.stride(1) != 1):
        raise ValueError(f"prefix must be ({m}, <= {k}) with contiguous rows, got {tuple(prefix.shape)}")
    if prefix_scale is not None and (prefix is None or prefix.shape[1] % prefix_scale.numel()
                                     or prefix_scale.dtype != torch.float32):
        raise ValueError("prefix_scale needs a prefix whose columns split into its float32 entries' groups")
    group = 1 if prefix_scale is None else prefix.shape[1] // prefix_scale.numel()
    if group & (group - 1):
        raise ValueError(f"prefix_scale's column groups must be a power of two wide, got {group}")
    if prefix is not None and prefix.dtype != x.dtype:  # one load reads both through one pointer type
        if prefix.dtype != FP8_DTYPE or prefix_scale is None:
            raise ValueError(f"prefix must have x's dtype {x.dtype} (or be FP8 with a prefix_scale), got {prefix.dtype}")
    if prefix_scale is not None:  # the scales apply in the select load
        prefix_select = True
    lead = x if prefix is None else prefix
    xq, scale = out if out is not None else (torch.empty(m, k, dtype=FP8_DTYPE, device=x.device),
                                             torch.empty(m, 1, dtype=torch.float32, device=x.device))
    one_sweep = k <= ONE_SWEEP_MAX_COLS
    _quantize_rows_kernel[(m,)](
        x, x.stride(0), lead, lead.stride(0), 0 if prefix is None else prefix.shape[1],
        scale if prefix_scale is None else prefix_scale, xq, xq.stride(0), scale, k,
        k if act_from is None else act_from,
        BLOCK=triton.next_power_of_2(k) if one_sweep else 2048, ONE_SWEEP=one_sweep, FP8_MAX=FP8_MAX,
        MIN_AMAX=MIN_AMAX, PREFIX=prefix is not None, PREFIX_SELECT=prefix_select,
        PREFIX_SCALED=prefix_scale is not None, GROUP=group, num_warps=num_warps,
    )
    return xq, scale


def quantize_rows(x: torch.Tensor, act_from: int | None = None, prefix: torch.Tensor | None = None,
                  prefix_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatcher: the Triton kernel on CUDA, the PyTorch reference otherwise."""
    if x.is_cuda:
        return quantize_rows_triton(x, act_from, prefix=prefix, prefix_scale=prefix_scale)
    return quantize_rows_reference(x, act_from, prefix, prefix_scale)
