"""Write one frame's keys and values into the KV ring cache: RoPE on K, FP8 quantisation, T slots.

Contract (shared with the Triton kernel): ``k_cache``/``v_cache`` are one layer's views
(n_heads, n_slots, head_dim) in float8_e4m3fn or bf16/fp32; ``k_scale``/``v_scale`` float32
(n_heads,); ``k_new``/``v_new`` (T, n_heads, head_dim) pre-RoPE; ``slot_start`` an int or a 0-d
int64 device tensor (a CUDA graph replays with a moving pointer); ``positions`` (T, 3) integer
(t, h, w); ``freqs`` the three RoPE frequency vectors. V gets no RoPE.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from charstream.kernels.fp8 import FP8_MAX, is_fp8, quantise
from charstream.kernels.rope import RopeFreqs, apply_rope, complex_rotation, rope_rotation, rotate_complex

RMS_EPS = 1e-6  # model/dit.py's RMSNorm


def ring_write_reference(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    slot_start: int | torch.Tensor,
    positions: torch.Tensor,
    freqs: RopeFreqs,
    rotation: torch.Tensor | None = None,
) -> None:
    """``rotation``: the positions' RoPE as ``complex_rotation`` tables when the caller already has them
    (the queries' tables), so they are not recomputed for every layer."""
    n_tokens = k_new.shape[0]
    if rotation is None:
        rotation = complex_rotation(rope_rotation(positions, freqs))
    k = rotate_complex(k_new, rotation)
    k_stored = quantise(k, k_scale[None, :, None], k_cache.dtype).transpose(0, 1)
    v_stored = quantise(v_new.float(), v_scale[None, :, None], v_cache.dtype).transpose(0, 1)
    if isinstance(slot_start, int):  # a plain slice copy (CPU index_copy_ is ~10x slower)
        k_cache[:, slot_start : slot_start + n_tokens].copy_(k_stored)
        v_cache[:, slot_start : slot_start + n_tokens].copy_(v_stored)
        return
    slots = slot_start + torch.arange(n_tokens, device=k_cache.device)
    # index_copy_ through a same-width integer view: works for fp8 on every backend, and the
    # index may live on the device, so the write pointer never leaves it.
    as_bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[k_cache.element_size()]
    k_cache.view(as_bits).index_copy_(1, slots, k_stored.contiguous().view(as_bits))
    v_cache.view(as_bits).index_copy_(1, slots, v_stored.contiguous().view(as_bits))


@triton.jit
def _rope_pair_freqs(pair, ft_ptr, fh_ptr, fw_ptr, NT: tl.constexpr, NH: tl.constexpr, NW: tl.constexpr):
    """Frequency and position group (0 = t, 1 = h, 2 = w) of each interleaved channel pair in ``pair``."""
    in_t = pair < NT
    in_h = (pair >= NT) & (pair < NT + NH)
    in_w = (pair >= NT + NH) & (pair < NT + NH + NW)
    f = tl.load(ft_ptr + pair, mask=in_t, other=0.0)
    f += tl.load(fh_ptr + (pair - NT), mask=in_h, other=0.0)
    f += tl.load(fw_ptr + (pair - NT - NH), mask=in_w, other=0.0)
    return f, tl.where(in_t, 0, tl.where(in_h, 1, 2))


@triton.jit
def _rope(x, cos, sin, BLOCK_T: tl.constexpr, D: tl.constexpr):
    # Interleaved pairs (x[2i], x[2i+1]) rotate as complex numbers.
    xe, xo = tl.split(tl.reshape(x, (BLOCK_T, D // 2, 2)))
    return tl.reshape(tl.join(xe * cos - xo * sin, xe * sin + xo * cos), (BLOCK_T, D))


@triton.jit
def _rms_norm(x, weight_ptr, D: tl.constexpr, EPS: tl.constexpr):
    w = tl.load(weight_ptr + tl.arange(0, D)).to(tl.float32)
    return x / tl.sqrt(tl.sum(x * x, 1) / D + EPS)[:, None] * w[None, :]


@triton.jit
def _ring_write_kernel(
    k_new, v_new, stride_nt, stride_nh, stride_vt, stride_vh,
    k_cache, v_cache, stride_ch, stride_cs,
    k_scale, v_scale, slot, pos, stride_pt,
    ft, fh, fw, n_tokens, n_heads,
    q, cq, q_norm, k_norm, cq_norm, saturated,
    D: tl.constexpr, NT: tl.constexpr, NH: tl.constexpr, NW: tl.constexpr, BLOCK_T: tl.constexpr,
    HEADS: tl.constexpr, SLOT_IN_TENSOR: tl.constexpr, QUANT: tl.constexpr, FP8_MAX: tl.constexpr,
    PREP: tl.constexpr, EPS: tl.constexpr,
):
    # One program: BLOCK_T tokens x HEADS heads (one head at a time), K and V together. The RoPE
    # angles depend on the token only, so their cos/sin (the costly part: precise trig per channel
    # pair) are computed once for the program's heads. With PREP, the block's other per-head work
    # rides along: QK-norms, RoPE on Q (in place), the cross-attention query's norm (in place) and
    # the FP8 saturation count.
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < n_tokens
    ch = tl.arange(0, D)
    freq, group = _rope_pair_freqs(tl.arange(0, D // 2), ft, fh, fw, NT, NH, NW)
    pt = tl.load(pos + t * stride_pt, mask=tmask, other=0)
    ph = tl.load(pos + t * stride_pt + 1, mask=tmask, other=0)
    pw = tl.load(pos + t * stride_pt + 2, mask=tmask, other=0)
    p = tl.where(group[None, :] == 0, pt[:, None], tl.where(group[None, :] == 1, ph[:, None], pw[:, None]))
    angle = p.to(tl.float32) * freq[None, :]
    cos = tl.cos(angle)
    sin = tl.sin(angle)
    # The write pointer may live on the device, so a CUDA graph replays with a moving ring position.
    if SLOT_IN_TENSOR:
        start = tl.load(slot)
    else:
        start = slot
    over = tl.full([], 0, tl.int64)
    for i in tl.static_range(HEADS):
        head = tl.program_id(1) * HEADS + i
        mask = (tmask & (tl.full((BLOCK_T,), head, tl.int32) < n_heads))[:, None]
        src = t[:, None] * stride_nt + head * stride_nh + ch[None, :]
        k = tl.load(k_new + src, mask=mask, other=0.0).to(tl.float32)
        v_src = t[:, None] * stride_vt + head * stride_vh + ch[None, :]
        v = tl.load(v_new + v_src, mask=mask, other=0.0).to(tl.float32)
        if PREP:
            k = _rms_norm(k, k_norm, D, EPS)
            qv = _rms_norm(tl.load(q + src, mask=mask, other=0.0).to(tl.float32), q_norm, D, EPS)
            tl.store(q + src, _rope(qv, cos, sin, BLOCK_T, D).to(q.dtype.element_ty), mask=mask)
            cqv = _rms_norm(tl.load(cq + src, mask=mask, other=0.0).to(tl.float32), cq_norm, D, EPS)
            tl.store(cq + src, cqv.to(cq.dtype.element_ty), mask=mask)
        k = _rope(k, cos, sin, BLOCK_T, D)
        if QUANT:
            ks = tl.load(k_scale + tl.minimum(head, n_heads - 1))
            vs = tl.load(v_scale + tl.minimum(head, n_heads - 1))
            if PREP:
                # As model/cache.py counts: a K pair whose norm passes the range may saturate at some rotation.
                ke, ko = tl.split(tl.reshape(k, (BLOCK_T, D // 2, 2)))
                over += tl.sum(tl.sum(((ke * ke + ko * ko) > (FP8_MAX * ks) * (FP8_MAX * ks)).to(tl.int64), 1), 0)
                over += tl.sum(tl.sum((tl.abs(v) > FP8_MAX * vs).to(tl.int64), 1), 0)
            k = tl.clamp(k / ks, -FP8_MAX, FP8_MAX)
            v = tl.clamp(v / vs, -FP8_MAX, FP8_MAX)
        dst = head * stride_ch + (start + t)[:, None] * stride_cs + ch[None, :]
        tl.store(k_cache + dst, k.to(k_cache.dtype.element_ty), mask=mask)
        tl.store(v_cache + dst, v.to(v_cache.dtype.element_ty), mask=mask)
    if PREP and QUANT:
        tl.atomic_add(saturated, over)


def _launch(k_cache, v_cache, k_scale, v_scale, k_new, v_new, slot_start, positions, freqs, prep,
            block_t=8, heads=4, num_warps=4):
    n_tokens, n_heads, head_dim = k_new.shape
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must share strides with a contiguous head_dim")
    if k_new.stride(-1) != 1 or v_new.stride(-1) != 1 or positions.stride(-1) != 1:
        raise ValueError("k_new/v_new need a contiguous head_dim; positions (T, 3) row-major")
    if block_t & (block_t - 1) or heads < 1:
        raise ValueError(f"block_t must be a power of two and heads >= 1, got {block_t} and {heads}")
    q, cq, q_norm, k_norm, cq_norm, saturated = prep if prep is not None else (k_new,) * 6
    if prep is not None and (q.stride() != k_new.stride() or cq.stride() != k_new.stride()):
        raise ValueError("q and cq must share k_new's strides (columns of one fused projection)")
    _ring_write_kernel[(triton.cdiv(n_tokens, block_t), triton.cdiv(n_heads, heads))](
        k_new, v_new, k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        k_cache, v_cache, k_cache.stride(0), k_cache.stride(1),
        k_scale, v_scale, slot_start, positions, positions.stride(0),
        freqs.t, freqs.h, freqs.w, n_tokens, n_heads,
        q, cq, q_norm, k_norm, cq_norm, saturated,
        D=head_dim, NT=freqs.t.numel(), NH=freqs.h.numel(), NW=freqs.w.numel(), BLOCK_T=block_t, HEADS=heads,
        SLOT_IN_TENSOR=isinstance(slot_start, torch.Tensor), QUANT=is_fp8(k_cache), FP8_MAX=FP8_MAX,
        PREP=prep is not None, EPS=RMS_EPS, num_warps=num_warps,
    )


def ring_write_triton(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    slot_start: int | torch.Tensor,
    positions: torch.Tensor,
    freqs: RopeFreqs,
    block_t: int = 8,
    heads: int = 4,
    num_warps: int = 4,
) -> None:
    """RoPE(K) + per-head FP8 quantisation + write of K and V for all heads: one launch of
    ``block_t`` tokens x ``heads`` heads per program."""
    _launch(k_cache, v_cache, k_scale, v_scale, k_new, v_new, slot_start, positions, freqs, None,
            block_t, heads, num_warps)


def ring_write_prep_reference(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    cq: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    slot_start: int | torch.Tensor,
    positions: torch.Tensor,
    freqs: RopeFreqs,
    norms: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    saturated: torch.Tensor,
) -> None:
    """The parallel block's per-head work between its input projection and its attentions, as
    model/dit.py + model/cache.py do it: q <- RoPE(q_norm(q)) and cq <- cross_q_norm(cq) in place;
    k_norm(k) and v written to the ring (``ring_write``); ``saturated`` += values out of FP8 range."""
    q_norm, k_norm, cq_norm = norms
    k = _rms_norm_reference(k_new, k_norm)
    q.copy_(apply_rope(_rms_norm_reference(q, q_norm), positions, freqs))
    cq.copy_(_rms_norm_reference(cq, cq_norm))
    if is_fp8(k_cache):
        limit_k, limit_v = (k_scale * FP8_MAX)[None, :, None], (v_scale * FP8_MAX)[None, :, None]
        pair_norm = apply_rope(k, positions, freqs).unflatten(-1, (-1, 2)).norm(dim=-1)
        saturated += (pair_norm > limit_k).sum() + (v_new.float().abs() > limit_v).sum()
    ring_write_reference(k_cache, v_cache, k_scale, v_scale, k, v_new, slot_start, positions, freqs)


def ring_write_prep_triton(
    q: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    cq: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    slot_start: int | torch.Tensor,
    positions: torch.Tensor,
    freqs: RopeFreqs,
    norms: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    saturated: torch.Tensor,
    block_t: int = 8,
    heads: int = 4,
    num_warps: int = 4,
) -> None:
    """``ring_write_prep_reference`` in one launch (the ring write kernel with its PREP extras on)."""
    q_norm, k_norm, cq_norm = norms
    _launch(k_cache, v_cache, k_scale, v_scale, k_new, v_new, slot_start, positions, freqs,
            (q, cq, q_norm, k_norm, cq_norm, saturated), block_t, heads, num_warps)


def _rms_norm_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """model/dit.py's RMSNorm: normalise in fp32, back to x's dtype, times the weight."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + RMS_EPS)).to(x.dtype) * weight


def ring_write(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    k_new: torch.Tensor,
    v_new: torch.Tensor,
    slot_start: int | torch.Tensor,
    positions: torch.Tensor,
    freqs: RopeFreqs,
    rotation: torch.Tensor | None = None,
) -> None:
    """Dispatcher: the Triton kernel on CUDA (which computes its own RoPE), the PyTorch reference
    otherwise (with the caller's ``rotation`` tables if given)."""
    if k_cache.is_cuda:
        ring_write_triton(k_cache, v_cache, k_scale, v_scale, k_new, v_new, slot_start, positions, freqs)
    else:
        ring_write_reference(k_cache, v_cache, k_scale, v_scale, k_new, v_new, slot_start, positions, freqs, rotation)
