"""Write one frame's keys and values into the KV ring cache: RoPE on K, FP8 quantization, T slots.

Contract (shared with the Triton kernel): ``k_cache``/``v_cache`` are one layer's views
(n_heads, n_slots, head_dim) in float8_e4m3fn or bf16/fp32; ``k_scale``/``v_scale`` float32
(n_heads,); ``k_new``/``v_new`` (T, n_heads, head_dim) pre-RoPE; ``slot_start`` an int or a 0-d
int64 device tensor (a CUDA graph replays with a moving pointer); ``positions`` (T, 3) integer
(t, h, w); ``freqs`` the three RoPE frequency vectors; ``rotation`` (optional) their ``rope_table``,
which the Triton kernel reads instead of computing trig. V gets no RoPE.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from charstream.kernels.fp8 import FP8_DTYPE, FP8_MAX, as_bits, dequantize, is_fp8, quantize
from charstream.kernels.rope import RopeFreqs, apply_rope, complex_rotation, rope_rotation, rotate_complex

RMS_EPS = 1e-6  # model/dit.py's RMSNorm


def rope_table(positions: torch.Tensor, freqs: RopeFreqs) -> torch.Tensor:
    """The positions' RoPE as the kernels read it: ``complex_rotation`` tables (T, 1, head_dim // 2),
    cos + i sin per token and channel pair. One frame's positions are the same for every layer and
    pass of a step, so the step builds this once and every write reads it."""
    return complex_rotation(rope_rotation(positions, freqs))


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
    """``rotation``: the positions' ``rope_table`` when the caller already has it (the queries'
    tables), so it is not recomputed for every layer."""
    n_tokens = k_new.shape[0]
    if rotation is None:
        rotation = rope_table(positions, freqs)
    k = rotate_complex(k_new, rotation)
    k_stored = quantize(k, k_scale[None, :, None], k_cache.dtype).transpose(0, 1)
    v_stored = quantize(v_new.float(), v_scale[None, :, None], v_cache.dtype).transpose(0, 1)
    if isinstance(slot_start, int):  # a plain slice copy (CPU index_copy_ is ~10x slower)
        k_cache[:, slot_start : slot_start + n_tokens].copy_(k_stored)
        v_cache[:, slot_start : slot_start + n_tokens].copy_(v_stored)
        return
    slots = slot_start + torch.arange(n_tokens, device=k_cache.device)
    # the index lives on the device, so the write pointer never leaves it
    as_bits(k_cache).index_copy_(1, slots, as_bits(k_stored.contiguous()))
    as_bits(v_cache).index_copy_(1, slots, as_bits(v_stored.contiguous()))


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
def _load_head(k_new, v_new, q, cq, t, tmask, head, n_heads, stride_nt, stride_nh, stride_vt, stride_vh,
               D: tl.constexpr, PREP: tl.constexpr):
    """One head's inputs for the program's tokens: K, V and (PREP) Q and cross-Q, as stored."""
    ch = tl.arange(0, D)
    mask = (tmask & (tl.full(t.shape, head, tl.int32) < n_heads))[:, None]
    src = t[:, None] * stride_nt + head * stride_nh + ch[None, :]
    k = tl.load(k_new + src, mask=mask, other=0.0)
    v = tl.load(v_new + t[:, None] * stride_vt + head * stride_vh + ch[None, :], mask=mask, other=0.0)
    if PREP:
        return k, v, tl.load(q + src, mask=mask, other=0.0), tl.load(cq + src, mask=mask, other=0.0)
    return k, v, k, v


@triton.jit
def _ring_write_kernel(
    k_new, v_new, stride_nt, stride_nh, stride_vt, stride_vh,
    k_cache, v_cache, stride_ch, stride_cs,
    k_scale, v_scale, slot, rot, stride_rt, n_tokens, n_heads,
    q, cq, q_norm, k_norm, cq_norm, saturated,
    k_win, v_win, stride_wh, stride_ws, win_slot, q8, stride_q8t, stride_q8h, q8_mult,
    D: tl.constexpr, BLOCK_T: tl.constexpr, HEADS: tl.constexpr, SLOT_IN_TENSOR: tl.constexpr,
    QUANT: tl.constexpr, FP8_MAX: tl.constexpr, PREP: tl.constexpr, WINDOW: tl.constexpr, EPS: tl.constexpr,
    PREFETCH: tl.constexpr, RING: tl.constexpr, WINDOW_CODES: tl.constexpr, Q8: tl.constexpr,
):
    # One program: BLOCK_T tokens x HEADS heads (one head at a time; PREFETCH: the next head's loads
    # issued before this head's stores, two heads' reads in flight for more registers: 4.11 against
    # 4.43 us per contract write on the H200), K and V together. The RoPE
    # cos/sin come from the step's table (computed once per step, not per program and layer). With
    # PREP, the block's other per-head work rides along: QK-norms, RoPE on Q (in place), the
    # cross-attention query's norm (in place) and the FP8 saturation count. With WINDOW, the keys and
    # values as stored are also written dequantized into the attention window's slots at ``win_slot``
    # (WINDOW_CODES: an FP8 window, the codes themselves). Q8: the rotated queries go to ``q8`` as e4m3
    # codes of q x q8_mult[head] (bf16-rounded first, as q would be stored), q itself left unwritten.
    # RING off: everything but the ring's stores (a measurement of what the write adds to the prep).
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    tmask = t < n_tokens
    ch = tl.arange(0, D)
    table = rot + t[:, None] * stride_rt + 2 * tl.arange(0, D // 2)[None, :]  # (cos, sin) pairs, float32
    cos = tl.load(table, mask=tmask[:, None], other=1.0)
    sin = tl.load(table + 1, mask=tmask[:, None], other=0.0)
    # The write pointers may live on the device, so a CUDA graph replays with a moving ring position.
    if SLOT_IN_TENSOR:
        start = tl.load(slot)
    else:
        start = slot
    if WINDOW:
        win_start = tl.load(win_slot)
    over = tl.full([], 0, tl.int64)
    first = tl.program_id(1) * HEADS
    if PREFETCH:
        nxt = _load_head(k_new, v_new, q, cq, t, tmask, first, n_heads, stride_nt, stride_nh, stride_vt, stride_vh, D,
                         PREP)
    for i in tl.static_range(HEADS):
        head = first + i
        if PREFETCH:
            k, v, qv, cqv = nxt
            if i + 1 < HEADS:
                nxt = _load_head(k_new, v_new, q, cq, t, tmask, head + 1, n_heads, stride_nt, stride_nh, stride_vt,
                                 stride_vh, D, PREP)
        else:
            k, v, qv, cqv = _load_head(k_new, v_new, q, cq, t, tmask, head, n_heads, stride_nt, stride_nh, stride_vt,
                                       stride_vh, D, PREP)
        mask = (tmask & (tl.full(t.shape, head, tl.int32) < n_heads))[:, None]
        src = t[:, None] * stride_nt + head * stride_nh + ch[None, :]
        k = k.to(tl.float32)
        v = v.to(tl.float32)
        if PREP:
            k = _rms_norm(k, k_norm, D, EPS)
            qv = _rope(_rms_norm(qv.to(tl.float32), q_norm, D, EPS), cos, sin, BLOCK_T, D).to(q.dtype.element_ty)
            if Q8:
                mult = tl.load(q8_mult + tl.minimum(head, n_heads - 1))
                q8dst = t[:, None] * stride_q8t + head * stride_q8h + ch[None, :]
                # no clamp: the caller's multipliers keep |codes| <= 448 (and Triton's e4m3 conversion
                # saturates), where the reference clamps explicitly
                tl.store(q8 + q8dst, (qv.to(tl.float32) * mult).to(q8.dtype.element_ty), mask=mask)
            else:
                tl.store(q + src, qv, mask=mask)
            tl.store(cq + src, _rms_norm(cqv.to(tl.float32), cq_norm, D, EPS).to(cq.dtype.element_ty), mask=mask)
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
        k_stored = k.to(k_cache.dtype.element_ty)
        v_stored = v.to(v_cache.dtype.element_ty)
        if RING:
            dst = head * stride_ch + (start + t)[:, None] * stride_cs + ch[None, :]
            tl.store(k_cache + dst, k_stored, mask=mask)
            tl.store(v_cache + dst, v_stored, mask=mask)
        if WINDOW_CODES:  # an FP8 window holds the ring's codes
            wdst = head * stride_wh + (win_start + t)[:, None] * stride_ws + ch[None, :]
            tl.store(k_win + wdst, k_stored, mask=mask)
            tl.store(v_win + wdst, v_stored, mask=mask)
        elif WINDOW:  # as gather_window dequantizes: stored value x per-head scale, in the window's dtype
            k_w = k_stored.to(tl.float32)
            v_w = v_stored.to(tl.float32)
            if QUANT:
                k_w = k_w * ks
                v_w = v_w * vs
            wdst = head * stride_wh + (win_start + t)[:, None] * stride_ws + ch[None, :]
            tl.store(k_win + wdst, k_w.to(k_win.dtype.element_ty), mask=mask)
            tl.store(v_win + wdst, v_w.to(v_win.dtype.element_ty), mask=mask)
    if PREP and QUANT:
        tl.atomic_add(saturated, over)


def launch_ring_write(k_cache, v_cache, k_scale, v_scale, k_new, v_new, slot_start, rotation, prep, window,
                      block_t, heads, num_warps, prefetch, write_ring=True, q8=None):
    """The kernel's one launcher, every knob: the entry points below call it. ``write_ring=False`` compiles the
    ring's stores out -- no serving mode: the benchmarks' measure of what the write adds to the prep."""
    n_tokens, n_heads, head_dim = k_new.shape
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must share strides with a contiguous head_dim")
    if k_new.stride(-1) != 1 or v_new.stride(-1) != 1:
        raise ValueError("k_new/v_new need a contiguous head_dim")
    if block_t & (block_t - 1) or heads < 1:
        raise ValueError(f"block_t must be a power of two and heads >= 1, got {block_t} and {heads}")
    table = torch.view_as_real(rotation.reshape(n_tokens, head_dim // 2))
    if table.stride(-2) != 2:
        raise ValueError("the RoPE table needs contiguous channel pairs")
    q, cq, q_norm, k_norm, cq_norm, saturated = prep if prep is not None else (k_new,) * 6
    if prep is not None and (q.stride() != k_new.stride() or cq.stride() != k_new.stride()):
        raise ValueError("q and cq must share k_new's strides (columns of one fused projection)")
    k_win, v_win, win_slot = window if window is not None else (k_cache, v_cache, slot_start)
    if window is not None and (k_win.stride() != v_win.stride() or k_win.stride(-1) != 1):
        raise ValueError("the window's K and V must share strides with a contiguous head_dim")
    window_codes = window is not None and is_fp8(k_win)
    if window_codes and not is_fp8(k_cache):
        raise ValueError("an FP8 window mirrors an FP8 ring's codes; this ring is not FP8")
    q8_out, q8_mult = q8 if q8 is not None else (k_new, k_scale)
    if q8 is not None and (prep is None or q8_out.shape != k_new.shape or q8_out.stride(-1) != 1 or not is_fp8(q8_out)):
        raise ValueError("q8 needs the prep and an FP8 (tokens, heads, head_dim) buffer with a contiguous head_dim")
    _ring_write_kernel[(triton.cdiv(n_tokens, block_t), triton.cdiv(n_heads, heads))](
        k_new, v_new, k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        k_cache, v_cache, k_cache.stride(0), k_cache.stride(1),
        k_scale, v_scale, slot_start, table, table.stride(0), n_tokens, n_heads,
        q, cq, q_norm, k_norm, cq_norm, saturated,
        k_win, v_win, k_win.stride(0), k_win.stride(1), win_slot, q8_out, q8_out.stride(0), q8_out.stride(1), q8_mult,
        D=head_dim, BLOCK_T=block_t, HEADS=heads, SLOT_IN_TENSOR=isinstance(slot_start, torch.Tensor),
        QUANT=is_fp8(k_cache), FP8_MAX=FP8_MAX, PREP=prep is not None, WINDOW=window is not None, EPS=RMS_EPS,
        PREFETCH=prefetch, RING=write_ring, WINDOW_CODES=window_codes, Q8=q8 is not None, num_warps=num_warps,
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
    rotation: torch.Tensor | None = None,
    block_t: int = 8,
    heads: int = 4,
    num_warps: int = 4,
    prefetch: bool = True,
) -> None:
    """RoPE(K) + per-head FP8 quantization + write of K and V for all heads: one launch of
    ``block_t`` tokens x ``heads`` heads per program. ``rotation``: the positions' ``rope_table``
    (built here when not given)."""
    rotation = rope_table(positions, freqs) if rotation is None else rotation
    launch_ring_write(k_cache, v_cache, k_scale, v_scale, k_new, v_new, slot_start, rotation, None, None,
            block_t, heads, num_warps, prefetch)


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
    rotation: torch.Tensor | None = None,
    window: tuple[torch.Tensor, torch.Tensor, int | torch.Tensor] | None = None,
    q8: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """The parallel block's per-head work between its input projection and its attentions, as
    model/dit.py + model/cache.py do it: q <- RoPE(q_norm(q)) and cq <- cross_q_norm(cq) in place;
    k_norm(k) and v written to the ring (``ring_write``); ``saturated`` += values out of FP8 range.
    ``window`` = (k_win, v_win, win_slot): the written K/V also go, dequantized as ``gather_window``
    does, into the attention window's slots from ``win_slot`` on (an FP8 window: the codes as stored).
    ``q8`` = (q8_out, mult (n_heads,) float32): the rotated queries go to q8_out as e4m3 codes of
    q x mult[head] instead of over q (the FP8 window attention's queries)."""
    q_norm, k_norm, cq_norm = norms
    k = _rms_norm_reference(k_new, k_norm)
    rotated = apply_rope(_rms_norm_reference(q, q_norm), positions, freqs).to(q.dtype)
    if q8 is None:
        q.copy_(rotated)
    else:
        q8[0].copy_((rotated.float() * q8[1][None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE))
    cq.copy_(_rms_norm_reference(cq, cq_norm))
    if is_fp8(k_cache):
        limit_k, limit_v = (k_scale * FP8_MAX)[None, :, None], (v_scale * FP8_MAX)[None, :, None]
        pair_norm = apply_rope(k, positions, freqs).unflatten(-1, (-1, 2)).norm(dim=-1)
        saturated += (pair_norm > limit_k).sum() + (v_new.float().abs() > limit_v).sum()
    ring_write_reference(k_cache, v_cache, k_scale, v_scale, k, v_new, slot_start, positions, freqs, rotation)
    if window is not None:
        k_win, v_win, win_slot = window
        n_tokens = k_new.shape[0]
        src = slot_start + torch.arange(n_tokens, device=k_cache.device)
        dst = win_slot + torch.arange(n_tokens, device=k_cache.device)
        for cache, scale, win in ((k_cache, k_scale, k_win), (v_cache, v_scale, v_win)):
            stored = as_bits(cache).index_select(1, src).view(cache.dtype)
            if is_fp8(win):
                as_bits(win).index_copy_(1, dst, as_bits(stored))
            else:
                win.index_copy_(1, dst, dequantize(stored, scale[:, None, None], win.dtype))


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
    rotation: torch.Tensor | None = None,
    window: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    block_t: int = 8,
    heads: int = 4,
    num_warps: int = 4,
    prefetch: bool = True,
    q8: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """``ring_write_prep_reference`` in one launch (the ring write kernel with its PREP extras on;
    ``window``'s slot a device tensor)."""
    q_norm, k_norm, cq_norm = norms
    rotation = rope_table(positions, freqs) if rotation is None else rotation
    launch_ring_write(k_cache, v_cache, k_scale, v_scale, k_new, v_new, slot_start, rotation,
            (q, cq, q_norm, k_norm, cq_norm, saturated), window, block_t, heads, num_warps, prefetch, q8=q8)


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
    """Dispatcher: the Triton kernel on CUDA, the PyTorch reference otherwise (``rotation``: the
    positions' ``rope_table`` when the caller already has it)."""
    write = ring_write_triton if k_cache.is_cuda else ring_write_reference
    write(k_cache, v_cache, k_scale, v_scale, k_new, v_new, slot_start, positions, freqs, rotation)
