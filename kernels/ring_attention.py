"""Attention of a new frame's queries over the KV ring cache, read in place.

Contract (shared with the Triton kernel): ``q`` (T, n_heads, head_dim) with RoPE applied, bf16/fp32;
``k_cache``/``v_cache`` one layer's (n_heads, n_slots, head_dim) in float8_e4m3fn or bf16/fp32 with
float32 per-head scales (n_heads,); ``ring_valid`` (ring_frames,) bool on the device; the first
``sink_slots`` slots are always attended, then ring frame r occupies slots
``sink_slots + r * tokens_per_frame`` onwards. Softmax scale 1/sqrt(head_dim). Returns q's dtype.
Softmax is order-free once positions are baked into the keys, so the ring is never unrolled.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from charstream.kernels.fp8 import dequantize, is_fp8


def ring_attention_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    ring_valid: torch.Tensor,
    sink_slots: int,
    tokens_per_frame: int,
) -> torch.Tensor:
    _check_layout(k_cache, ring_valid, sink_slots, tokens_per_frame)
    k = dequantize(k_cache, k_scale[:, None, None])
    v = dequantize(v_cache, v_scale[:, None, None])
    slot_valid = torch.cat(
        [torch.ones(sink_slots, dtype=torch.bool, device=q.device), ring_valid.repeat_interleave(tokens_per_frame)]
    )
    # 4-D inputs: CPU SDPA takes its fused kernel for those (3-D falls back to the slow math path).
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None], k[None], v[None], attn_mask=slot_valid[None, None, None, :]
    )
    return out[0].transpose(0, 1).to(q.dtype)


def ring_attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    ring_valid: torch.Tensor,
    sink_slots: int,
    tokens_per_frame: int,
    slot_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The CPU path: plain math (bmm, one softmax, bmm) over the whole ring read in place, invalid
    frames masked to -inf. At `tiny`'s 20 queries x head_dim 16 per-op overhead, not FLOPs, bounds
    CPU attention: one masked pass is ~2x faster than SDPA's CPU flash kernel per valid run + a
    log-sum-exp merge, and gathering the valid runs first (a copy of the window) saves only ~50 us.
    FP8 scales fold into the queries (K) and the output (V), as in the Triton kernel.

    ``slot_bias``: ``ring_slot_bias(ring_valid, ...)`` if the caller keeps it (it changes once a frame)."""
    _check_layout(k_cache, ring_valid, sink_slots, tokens_per_frame)
    # The mask as an additive bias (0 / -inf per slot), added in place along the scores' contiguous last
    # dim: x + 0 is exact, and a masked_fill_ with a broadcast bool mask costs twice the bmm on CPU.
    bias = slot_bias if slot_bias is not None else ring_slot_bias(ring_valid, sink_slots, tokens_per_frame)
    quant = is_fp8(k_cache)
    softmax_scale = 1.0 / math.sqrt(q.shape[-1])
    qh = q.float().transpose(0, 1) * (k_scale[:, None, None] * softmax_scale if quant else softmax_scale)
    scores = torch.bmm(qh, k_cache.float().mT).add_(bias)  # .float(): no copy for fp32
    out = torch.bmm(torch.softmax(scores, dim=-1), v_cache.float())
    if quant:
        out = out * v_scale[:, None, None]
    return out.transpose(0, 1).to(q.dtype)


def ring_slot_bias(ring_valid: torch.Tensor, sink_slots: int, tokens_per_frame: int) -> torch.Tensor:
    """Additive attention bias per cache slot, float32 (n_slots,): 0 for the sink and valid ring frames,
    -inf for the others."""
    bias = torch.zeros(sink_slots + ring_valid.numel() * tokens_per_frame, dtype=torch.float32, device=ring_valid.device)
    bias[sink_slots:].view(-1, tokens_per_frame).masked_fill_(~ring_valid[:, None], float("-inf"))
    return bias


def _check_layout(k_cache: torch.Tensor, ring_valid: torch.Tensor, sink_slots: int, tokens_per_frame: int) -> None:
    n_slots = k_cache.shape[1]
    if n_slots != sink_slots + ring_valid.numel() * tokens_per_frame:
        raise ValueError(
            f"cache has {n_slots} slots, expected {sink_slots} sink + {ring_valid.numel()} x {tokens_per_frame} ring"
        )


@triton.jit
def _attended_block(kb, csum, sink_slots, tokens_per_frame, SB: tl.constexpr, BPF: tl.constexpr, BLOCK_N: tl.constexpr):
    """Slot range of attended key block ``kb``: the sink's SB blocks, then BPF blocks of each valid ring
    frame in ring order (``csum``: inclusive prefix count of ``ring_valid``). Returns (first slot, end)."""
    fb = kb - SB
    j = fb // BPF
    pos = tl.sum((csum <= j).to(tl.int32), 0)  # ring position of the j-th valid frame
    frame_start = sink_slots + pos * tokens_per_frame
    in_sink = kb < SB
    start = tl.where(in_sink, kb * BLOCK_N, frame_start + (fb - j * BPF) * BLOCK_N)
    end = tl.where(in_sink, sink_slots, frame_start + tokens_per_frame)
    return start, end


@triton.jit
def _ring_attention_kernel(
    q, stride_qt, stride_qh, k, v, stride_kh, stride_ks, k_scale, v_scale, ring_valid, n_ring,
    out, stride_ot, stride_oh, part_o, part_lse, n_tokens, n_heads, sink_slots, tokens_per_frame, softmax_scale_log2,
    D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SB: tl.constexpr, BPF: tl.constexpr,
    RING_P2: tl.constexpr, QUANT: tl.constexpr,
):
    # Persistent stream-K flash attention over the attended key blocks only: invalid ring frames
    # cost nothing. The work -- (head, query block) tiles x attended key blocks -- is cut into one
    # equal contiguous range per program, so every SM gets the same number of key blocks whatever
    # the tile count (one tile per program left 1-2 programs per SM, unevenly).
    # A tile whose range spans programs leaves its pieces (normalised output, log-sum-exp) in
    # part_o/part_lse, slot 2 x program + 0 for a program's first piece and + 1 for its last, for
    # _ring_attention_merge_kernel. FP8 K/V stay FP8 in memory: the per-head K scale folds into the
    # softmax scale and the V scale into the output; the products run in fp16, to which e4m3
    # widens exactly (bf16 costs several instructions per value).
    pid = tl.program_id(0)
    n_prog = tl.num_programs(0)
    r = tl.arange(0, RING_P2)
    valid = (tl.load(ring_valid + r, mask=r < n_ring, other=0) != 0).to(tl.int32)
    csum = tl.cumsum(valid, 0)
    n_kb = SB + tl.sum(valid, 0) * BPF
    n_mb = tl.cdiv(n_tokens, BLOCK_M)
    units = (n_mb * n_heads * n_kb).to(tl.int64)
    u0 = pid * units // n_prog
    u1 = (pid + 1) * units // n_prog
    d = tl.arange(0, D)
    u = u0
    while u < u1:
        tile = (u // n_kb).to(tl.int32)
        kb_lo = (u - tile * n_kb).to(tl.int32)
        kb_hi = tl.minimum(n_kb, kb_lo + (u1 - u)).to(tl.int32)
        head = tile // n_mb
        m = (tile % n_mb) * BLOCK_M + tl.arange(0, BLOCK_M)
        mmask = m < n_tokens
        qb = tl.load(q + m[:, None] * stride_qt + head * stride_qh + d[None, :], mask=mmask[:, None], other=0.0)
        row_scale = tl.full((BLOCK_M,), softmax_scale_log2, tl.float32)
        if QUANT:
            row_scale = row_scale * tl.load(k_scale + head)
            qb = qb.to(tl.float16)
        # A finite start: a block with no valid slot leaves the running max finite, so no inf - inf.
        m_i = tl.full((BLOCK_M,), -1.0e30, tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, D), tl.float32)
        for kb in range(kb_lo, kb_hi):
            start, end = _attended_block(kb, csum, sink_slots, tokens_per_frame, SB, BPF, BLOCK_N)
            n = start + tl.arange(0, BLOCK_N)
            in_block = n < end
            offs = head * stride_kh + n[:, None] * stride_ks + d[None, :]
            kb_tile = tl.load(k + offs, mask=in_block[:, None], other=0.0).to(qb.dtype)
            s = tl.dot(qb, tl.trans(kb_tile))
            s = tl.where(in_block[None, :], s * row_scale[:, None], float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.math.exp2(s - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            vb = tl.load(v + offs, mask=in_block[:, None], other=0.0)
            vb = vb.to(tl.float16) if QUANT else vb.to(q.dtype.element_ty)
            acc = acc * alpha[:, None] + tl.dot(p.to(vb.dtype), vb)
            m_i = m_new
        if QUANT:
            acc = acc * tl.load(v_scale + head)
        acc = acc / l_i[:, None]
        if (kb_lo == 0) & (kb_hi == n_kb):
            dst = m[:, None] * stride_ot + head * stride_oh + d[None, :]
            tl.store(out + dst, acc.to(out.dtype.element_ty), mask=mmask[:, None])
        else:
            slot = 2 * pid + (u != u0).to(tl.int32)
            rows = slot * BLOCK_M + tl.arange(0, BLOCK_M)
            tl.store(part_o + rows[:, None] * D + d[None, :], acc)
            tl.store(part_lse + rows, m_i + tl.math.log2(l_i))
        u += kb_hi - kb_lo


@triton.jit
def _ring_attention_merge_kernel(
    ring_valid, n_ring, out, stride_ot, stride_oh, part_o, part_lse, n_tokens, n_heads, n_prog,
    D: tl.constexpr, BLOCK_M: tl.constexpr, SB: tl.constexpr, BPF: tl.constexpr, RING_P2: tl.constexpr,
):
    # One program per tile: merge the pieces that the programs covering its key blocks left, weighted
    # by their log-sum-exp. A tile that one program covered whole was written directly: skipped.
    tile = tl.program_id(0)
    r = tl.arange(0, RING_P2)
    n_kb = SB + tl.sum((tl.load(ring_valid + r, mask=r < n_ring, other=0) != 0).to(tl.int32), 0) * BPF
    n_mb = tl.cdiv(n_tokens, BLOCK_M)
    units = (n_mb * n_heads * n_kb).to(tl.int64)
    t0 = tile.to(tl.int64) * n_kb
    p_lo = ((t0 + 1) * n_prog - 1) // units  # the last program whose range starts at or before t0
    p_hi = ((t0 + n_kb) * n_prog - 1) // units  # the last program whose range starts before the tile's end
    if p_hi > p_lo:
        head = tile // n_mb
        m = (tile % n_mb) * BLOCK_M + tl.arange(0, BLOCK_M)
        d = tl.arange(0, D)
        big = tl.full((BLOCK_M,), -1.0e30, tl.float32)
        wsum = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, D), tl.float32)
        for p in range(p_lo, p_hi + 1):
            pu0 = p * units // n_prog
            if pu0 < (p + 1) * units // n_prog:  # programs with an empty range left nothing
                slot = 2 * p + (pu0 < t0).to(tl.int64)
                rows = slot * BLOCK_M + tl.arange(0, BLOCK_M)
                lse = tl.load(part_lse + rows)
                new = tl.maximum(big, lse)
                alpha = tl.math.exp2(big - new)
                w = tl.math.exp2(lse - new)
                acc = acc * alpha[:, None] + tl.load(part_o + rows[:, None] * D + d[None, :]) * w[:, None]
                wsum = wsum * alpha + w
                big = new
        dst = m[:, None] * stride_ot + head * stride_oh + d[None, :]
        tl.store(out + dst, (acc / wsum[:, None]).to(out.dtype.element_ty), mask=(m < n_tokens)[:, None])


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def ring_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    ring_valid: torch.Tensor,
    sink_slots: int,
    tokens_per_frame: int,
    block_m: int = 128,
    block_n: int = 128,
    num_warps: int = 8,
    num_stages: int | None = None,
    out: torch.Tensor | None = None,
    programs: int | None = None,
) -> torch.Tensor:
    """The ring attention as one persistent stream-K launch + one small merge launch, over the sink and
    the valid ring frames only, read in place; the block shape defaults are the fastest of a sweep on
    an H200; ``num_stages`` defaults to 4 over FP8 caches, 2 over 2-byte ones (four
    stages of 128 x 128 bf16 K and V tiles pass the shared memory). ``programs``: the persistent grid
    (default: 8 warps' worth per SM). With no ring
    (``ring_valid`` empty: the sink alone) every program takes one whole tile and no merge runs.

    ``out`` (T, n_heads, head_dim), any strides with a contiguous head_dim, lets the caller have the
    result land straight in a larger buffer (e.g. the output projection's input) with no copy; it
    may be ``q`` itself (a tile's queries are read only by the programs that produce its output)."""
    _check_layout(k_cache, ring_valid, sink_slots, tokens_per_frame)
    if q.stride(-1) != 1 or k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("q, k_cache and v_cache need a contiguous head_dim; k_cache and v_cache the same strides")
    n_tokens, n_heads, head_dim = q.shape
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} with a contiguous head_dim, got {tuple(out.shape)}")
    if num_stages is None:
        num_stages = 4 if k_cache.element_size() == 1 else 2
    n_ring = ring_valid.numel()
    sink_blocks = triton.cdiv(sink_slots, block_n)
    n_tiles = triton.cdiv(n_tokens, block_m) * n_heads
    if n_ring == 0:
        programs, merge = n_tiles * sink_blocks, sink_blocks > 1
    else:
        # about 8 warps per SM: one 8-warp program or two 4-warp ones (on an H200: 0.168 ms for 64-row
        # blocks at two per SM, 0.230 at one)
        per_sm = max(1, 8 // num_warps)
        programs, merge = programs or (_sm_count(q.device.index or 0) * per_sm if q.is_cuda else 4), True
    part_o = torch.empty(2 * programs * block_m if merge else 1, head_dim, dtype=torch.float32, device=q.device)
    part_lse = torch.empty(2 * programs * block_m if merge else 1, dtype=torch.float32, device=q.device)
    blocks = {"SB": sink_blocks, "BPF": triton.cdiv(tokens_per_frame, block_n),
              "RING_P2": max(2, triton.next_power_of_2(n_ring))}
    # With no ring the flags are never read (every load masked): q stands in for the pointer, so no
    # placeholder tensor is made (and filled: one more launch) per call.
    valid = ring_valid.view(torch.uint8) if n_ring else q
    _ring_attention_kernel[(programs,)](
        q, q.stride(0), q.stride(1), k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_scale, v_scale,
        valid, n_ring, out, out.stride(0), out.stride(1), part_o, part_lse, n_tokens, n_heads, sink_slots,
        tokens_per_frame, math.log2(math.e) / math.sqrt(head_dim),
        D=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, **blocks, QUANT=is_fp8(k_cache),
        num_warps=num_warps, num_stages=num_stages,
    )
    if merge:
        _ring_attention_merge_kernel[(n_tiles,)](
            valid, n_ring, out, out.stride(0), out.stride(1), part_o, part_lse, n_tokens, n_heads, programs,
            D=head_dim, BLOCK_M=block_m, **blocks, num_warps=4,
        )
    return out


@triton.jit
def _gather_window_kernel(
    k, v, stride_kh, stride_ks, k_scale, v_scale, frame_order, k_out, v_out, stride_oh, stride_os,
    n_out, sink_slots, tokens_per_frame,
    D: tl.constexpr, BLOCK_S: tl.constexpr, QUANT: tl.constexpr,
):
    # Output slot j: the sink for j < sink_slots, else token (j - sink) % T of the ring frame at
    # position frame_order[(j - sink) // T]; dequantized to the output dtype (bf16), or (QUANT off
    # over an FP8 ring: an FP8 window) the codes copied.
    head = tl.program_id(1)
    j = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    jmask = j < n_out
    in_ring = (j >= sink_slots) & jmask
    r = tl.maximum(j - sink_slots, 0)
    pos = tl.load(frame_order + r // tokens_per_frame, mask=in_ring, other=0)
    src = tl.where(in_ring, sink_slots + pos * tokens_per_frame + r % tokens_per_frame, j)
    d = tl.arange(0, D)
    offs = head * stride_kh + src[:, None] * stride_ks + d[None, :]
    kb = tl.load(k + offs, mask=jmask[:, None], other=0.0).to(tl.float32)
    vb = tl.load(v + offs, mask=jmask[:, None], other=0.0).to(tl.float32)
    if QUANT:
        kb = kb * tl.load(k_scale + head)
        vb = vb * tl.load(v_scale + head)
    dst = head * stride_oh + j[:, None] * stride_os + d[None, :]
    tl.store(k_out + dst, kb.to(k_out.dtype.element_ty), mask=jmask[:, None])
    tl.store(v_out + dst, vb.to(v_out.dtype.element_ty), mask=jmask[:, None])


def gather_window(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    frame_order: torch.Tensor,
    sink_slots: int,
    tokens_per_frame: int,
    out: tuple[torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dequantize the sink + the ring frames at positions ``frame_order`` (int32 device tensor) into
    contiguous (n_heads, sink + len(order) * T, head_dim) K and V buffers ``out``: one launch. FP8
    ``out`` buffers get the ring's codes as they are (the FP8 window attention applies the scales)."""
    k_out, v_out = out
    if is_fp8(k_out) and not is_fp8(k_cache):
        raise ValueError("an FP8 window holds an FP8 ring's codes; this ring is not FP8")
    n_heads, n_out, head_dim = k_out.shape
    if n_out != sink_slots + frame_order.numel() * tokens_per_frame or v_out.stride() != k_out.stride():
        raise ValueError("out buffers must hold sink + len(frame_order) frames with the same strides")
    block_s = 64
    _gather_window_kernel[(triton.cdiv(n_out, block_s), n_heads)](
        k_cache, v_cache, k_cache.stride(0), k_cache.stride(1), k_scale, v_scale, frame_order,
        k_out, v_out, k_out.stride(0), k_out.stride(1), n_out, sink_slots, tokens_per_frame,
        D=head_dim, BLOCK_S=block_s, QUANT=is_fp8(k_cache) and not is_fp8(k_out), num_warps=4,
    )
    return k_out, v_out


def window_attention(q: torch.Tensor, k_win: torch.Tensor, v_win: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """q (T, n_heads, head_dim) over every slot of a contiguous window (n_heads, S, head_dim) through
    PyTorch's cuDNN SDPA (flash if cuDNN declines); key order is irrelevant to attention, so the
    window may hold its frames in any order. Written into ``out`` (T, n_heads, head_dim); without
    ``out``, the (T, n_heads, head_dim) view of SDPA's own output buffer is returned, no copy made
    (its layout follows q's, so it flattens to (T, n_heads * head_dim) rows when q is such columns)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    # q as the strided (heads, tokens) view it is: cuDNN reads it in place (measured faster than a
    # contiguous copy, and faster than a contiguous buffer too: 90.8 against 96.6-100.6 us on an H200)
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION]):
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k_win[None], v_win[None])
    if out is None:
        return o[0].transpose(0, 1)
    out.copy_(o[0].transpose(0, 1))
    return out


def ring_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    ring_valid: torch.Tensor,
    sink_slots: int,
    tokens_per_frame: int,
    slot_bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dispatcher: the Triton kernel on CUDA, the plain-math CPU path on CPU (``slot_bias``: the caller's
    ``ring_slot_bias``, if it keeps one), else the reference."""
    args = (q, k_cache, v_cache, k_scale, v_scale, ring_valid, sink_slots, tokens_per_frame)
    if q.is_cuda:
        return ring_attention_triton(*args)
    if q.device.type == "cpu":
        return ring_attention_cpu(*args, slot_bias=slot_bias)
    return ring_attention_reference(*args)
