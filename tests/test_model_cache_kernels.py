"""The three cache kernels' PyTorch references against plain math (the Triton kernels are checked
against these references on the GPU)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from charstream.kernels.delta_rotate import delta_rotate
from charstream.kernels.fp8 import FP8_DTYPE, dequantize
from charstream.kernels.ring_attention import (
    ring_attention,
    ring_attention_cpu,
    ring_attention_reference,
    ring_slot_bias,
)
from charstream.kernels.ring_write import ring_write
from charstream.kernels.rope import (
    apply_rope,
    complex_rotation,
    rope_freqs,
    rope_rotation,
    rope_split,
    rotate,
    rotate_complex,
)
from charstream.model.rope import frame_positions

H, D, T, SINK_FRAMES, RING = 3, 16, 10, 1, 4


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_rope_split_matches_contract():
    assert rope_split(16) == (8, 4, 4)
    assert rope_split(128) == (44, 42, 42)


@pytest.mark.parametrize("dtype", [torch.float32, FP8_DTYPE])
def test_write_then_attend_equals_plain_attention(dtype):
    g = torch.Generator().manual_seed(1)
    freqs = rope_freqs(D)
    n_slots = (SINK_FRAMES + RING) * T
    k_cache = torch.zeros(H, n_slots, D, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    scale = torch.full((H,), 4.0 / 448)  # values stay well inside the fp8 range
    frames = [(torch.randn(T, H, D, generator=g), torch.randn(T, H, D, generator=g)) for _ in range(3)]
    # sink at t=0; ring frames 0..2 at t=1..3 in ring positions 0..2; position 3 stays invalid
    ks, vs = [], []
    for i, (k, v) in enumerate(frames):
        pos = frame_positions(i, (2, 4), 2)
        start = 0 if i == 0 else SINK_FRAMES * T + (i - 1) * T
        ring_write(k_cache, v_cache, scale, scale, k, v, torch.tensor(start), pos, freqs)
        ks.append(apply_rope(k, pos, freqs))
        vs.append(v)
    ring_valid = torch.tensor([True, True, False, False])
    q = torch.randn(T, H, D, generator=g)
    out = ring_attention(q, k_cache, v_cache, scale, scale, ring_valid, SINK_FRAMES * T, T)
    k_all, v_all = torch.cat(ks), torch.cat(vs)
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), k_all.transpose(0, 1), v_all.transpose(0, 1))
    # fp8 e4m3 keeps 3 mantissa bits: ~3% relative error per value, less after averaging
    assert _rel(out, ref.transpose(0, 1)) < (1e-5 if dtype == torch.float32 else 0.05)
    # untouched slots stay exactly zero: the write touched its T slots only
    assert dequantize(k_cache[:, 3 * T :], scale[:, None, None]).abs().sum() == 0


@pytest.mark.parametrize("dtype", [torch.float32, FP8_DTYPE])
def test_delta_rotate_equals_rewrite_at_shifted_positions(dtype):
    g = torch.Generator().manual_seed(2)
    freqs = rope_freqs(D)
    n_layers, n_slots = 2, (SINK_FRAMES + RING) * T
    raw = torch.randn(n_layers, RING + 1, T, H, D, generator=g)
    scale = torch.full((n_layers, H), 4.0 / 448)

    def build(shift: int) -> torch.Tensor:
        k_all = torch.zeros(n_layers, H, n_slots, D, dtype=dtype)
        v_all = torch.zeros_like(k_all)
        for layer in range(n_layers):
            for f in range(RING + 1):  # f = 0 is the sink: its position never shifts
                t = 0 if f == 0 else 50 + f - shift
                ring_write(k_all[layer], v_all[layer], scale[layer], scale[layer], raw[layer, f], raw[layer, f],
                           f * T, frame_positions(t, (2, 4), 2), freqs)
        return k_all

    rotated = build(0)
    delta_rotate(rotated, scale, 42, freqs.t, SINK_FRAMES * T)
    fresh = build(42)
    tol = 1e-5 if dtype == torch.float32 else 0.04
    assert _rel(dequantize(rotated, scale[..., None, None]), dequantize(fresh, scale[..., None, None])) < tol
    # sink keys are untouched, bit for bit
    assert torch.equal(rotated[:, :, : SINK_FRAMES * T].float(), fresh[:, :, : SINK_FRAMES * T].float())
    assert math.isfinite(dequantize(rotated, scale[..., None, None]).abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, FP8_DTYPE])
@pytest.mark.parametrize(
    "valid",
    [[False] * 4, [True] * 4, [True, True, False, False], [False, True, True, False], [True, False, False, True]],
)
def test_cpu_segment_attention_equals_reference(dtype, valid):
    g = torch.Generator().manual_seed(3)
    n_slots = (SINK_FRAMES + RING) * T
    k_cache = (torch.randn(H, n_slots, D, generator=g) * 10).to(dtype)
    v_cache = (torch.randn(H, n_slots, D, generator=g) * 10).to(dtype)
    scale = torch.rand(H, generator=g) + 0.05
    q = torch.randn(T, H, D, generator=g)
    ring_valid = torch.tensor(valid)
    args = (q, k_cache, v_cache, scale, scale, ring_valid, SINK_FRAMES * T, T)
    torch.testing.assert_close(ring_attention_cpu(*args), ring_attention_reference(*args), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ring_attention(*args), ring_attention_reference(*args), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, FP8_DTYPE])
def test_cpu_attention_at_tiny_shapes_matches_reference(dtype):
    """`tiny`'s shapes (12 heads x 16, 20 tokens, 12 ring frames): a window wrapped around the ring's
    end, one continuing the sink, and one in the middle."""
    g = torch.Generator().manual_seed(4)
    heads, tokens, ring = 12, 20, 12
    n_slots = (SINK_FRAMES + ring) * tokens
    k_cache = (torch.randn(heads, n_slots, D, generator=g) * 3).to(dtype)
    v_cache = (torch.randn(heads, n_slots, D, generator=g) * 3).to(dtype)
    k_scale, v_scale = torch.rand(heads, generator=g) + 0.05, torch.rand(heads, generator=g) + 0.05
    q = torch.randn(tokens, heads, D, generator=g) * 2
    for first in (7, 0, 2):  # 8 valid frames from ring position `first`, wrapping past the end
        ring_valid = torch.zeros(ring, dtype=torch.bool)
        ring_valid[[(first + i) % ring for i in range(8)]] = True
        args = (q, k_cache, v_cache, k_scale, v_scale, ring_valid, SINK_FRAMES * tokens, tokens)
        assert _rel(ring_attention_cpu(*args), ring_attention_reference(*args)) < 1e-6
        bias = ring_slot_bias(ring_valid, SINK_FRAMES * tokens, tokens)  # as model/cache.py keeps it
        assert torch.equal(ring_attention_cpu(*args, slot_bias=bias), ring_attention_cpu(*args))


def test_complex_rotation_equals_rotate():
    """The CPU path's one-op RoPE (queries and ring keys) against model/rope.py's, on strided slices of
    a fused projection as the DiT hands them over."""
    g = torch.Generator().manual_seed(5)
    freqs = rope_freqs(D)
    positions = frame_positions(3, (2, 2), 1, "cpu")
    tables = rope_rotation(positions, freqs)
    fused = torch.randn(positions.shape[0], 4, H, D, generator=g)
    for x in (fused[:, 0], fused[:, 1], fused[:, 1].contiguous()):
        torch.testing.assert_close(rotate_complex(x, complex_rotation(tables)), rotate(x, *tables), rtol=1e-6, atol=1e-6)
