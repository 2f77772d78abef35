"""The FP8 window attention's references on the CPU: the attention over e4m3 codes, the prep's q codes and
FP8 window, the output rows read with per-head scales. cuDNN's kernel, the Triton kernels and the step
against these run on the GPU (tests/test_kernels_gpu.py, tests/test_graphed_gpu.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from charstream.kernels.fp8 import FP8_DTYPE
from charstream.kernels.fp8_window_attention import (
    choose_window_splits,
    fp8_window_attention_reference,
    fp8_window_partials_reference,
)
from charstream.kernels.quantize_rows import quantize_rows_reference
from charstream.kernels.ring_write import ring_write_prep_reference
from charstream.kernels.rope import apply_rope, rope_freqs
from charstream.model.config import TINY
from charstream.model.generator import Generator
from charstream.model.rope import frame_positions
from charstream.model.step import StepOptions

H, D, T = 3, 16, 12


def _codes(*shape: int) -> torch.Tensor:
    return (torch.randn(*shape) * 50).clamp(-448, 448).to(FP8_DTYPE)


def test_attention_reference_is_sdpa_over_the_codes_values():
    q8, k8, v8 = _codes(T, H, D), _codes(H, 40, D), _codes(H, 40, D)
    dq, dk, dv = torch.tensor([0.01]), torch.tensor([0.02]), torch.tensor([0.03])
    got = fp8_window_attention_reference(q8, k8, v8, dq, dk, dv, D**-0.5)
    want = F.scaled_dot_product_attention((q8.float() * dq).transpose(0, 1), k8.float() * dk, v8.float() * dv)
    assert torch.allclose(got, want.transpose(0, 1), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("splits", [2, 4])
def test_partials_weighted_by_their_statistics_are_the_whole_window(splits):
    q8, k8, v8 = _codes(T, H, D), _codes(H, 40, D), _codes(H, 40, D)
    dq, dk, dv = torch.tensor([0.01]), torch.tensor([0.02]), torch.tensor([0.03])
    parts, lse = fp8_window_partials_reference(q8, k8, v8, dq, dk, dv, D**-0.5, splits)
    assert parts.shape == (splits, T, H, D) and lse.shape == (splits, H, T)
    weights = (lse - lse.logsumexp(0, keepdim=True)).exp()  # (splits, H, T), summing to 1
    merged = (parts * weights.transpose(1, 2)[..., None]).sum(0)
    assert torch.allclose(merged, fp8_window_attention_reference(q8, k8, v8, dq, dk, dv, D**-0.5), rtol=1e-4, atol=1e-5)
    scores = torch.einsum("thd,hsd->hts", q8.float() * dq, k8.float() * dk) * D**-0.5
    assert torch.allclose(lse.logsumexp(0), scores.logsumexp(-1), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("heads", "queries", "keys", "splits"), [
    (15, 757, 8 * 757, 4), (20, 757, 8 * 757, 1), (30, 757, 8 * 757, 2), (60, 757, 8 * 757, 1), (40, 757, 8 * 757, 1),
    (2, 20, 180, 4),  # the tiny GPU tests' window: 2 heads, 20 tokens, 180 keys (8 does not divide them)
])
def test_the_window_is_split_where_the_query_tiles_leave_an_sm_wave_idle(heads, queries, keys, splits):
    # 757 queries: 6 tiles a head; 15 heads fill 90 of 132 SMs (4 ways: 3 waves of a quarter), 20 heads
    # 120 (no split under 11 gains), 30 heads 180 (2 ways: 3 waves of a half, not 2 full ones)
    assert choose_window_splits(heads, queries, keys, 132) == splits


def test_a_split_must_divide_the_keys():
    assert choose_window_splits(15, 757, 6057, 132) == 1  # no candidate divides 6,057 keys


def test_rows_reference_applies_the_prefix_scale_per_column_group():
    x = torch.randn(T, 5 * H * D).bfloat16()
    codes = _codes(T, H, D).flatten(1)
    head_scale = torch.tensor([0.5, 2.0, 0.125])
    got_q, got_scale = quantize_rows_reference(x, 2 * H * D, prefix=codes, prefix_scale=head_scale)
    real = torch.cat([codes.float()[:, i * D : (i + 1) * D] * head_scale[i] for i in range(H)], dim=1)
    want_q, want_scale = quantize_rows_reference(torch.cat([real, x[:, H * D :].float()], dim=1), 2 * H * D)
    assert torch.equal(got_scale, want_scale) and torch.equal(got_q.float(), want_q.float())


def test_prep_reference_writes_q_codes_and_the_ring_codes_into_an_fp8_window():
    freqs = rope_freqs(D)
    positions = frame_positions(5, (3, 4), 0, "cpu")
    fused = torch.randn(T, 4 * H * D).bfloat16() * 3
    q, k, v, cq = (fused[:, i * H * D : (i + 1) * H * D].unflatten(-1, (H, D)) for i in range(4))
    q_before = q.clone()
    norms = tuple(torch.rand(D) + 0.5 for _ in range(3))
    k_scale, v_scale = torch.full((H,), 0.02), torch.full((H,), 0.03)
    n_slots = 4 * T
    ring = [torch.zeros(H, n_slots, D).to(FP8_DTYPE) for _ in range(2)]
    window = [torch.full((H, 3 * T, D), 7.0).to(FP8_DTYPE) for _ in range(2)]
    q8, mult = torch.zeros(T, H, D).to(FP8_DTYPE), torch.tensor([4.0, 8.0, 16.0])
    saturated = torch.zeros((), dtype=torch.int64)
    ring_write_prep_reference(q, k, v, cq, *ring, k_scale, v_scale, 2 * T, positions, freqs, norms, saturated,
                              window=(*window, T), q8=(q8, mult))
    assert torch.equal(q, q_before)  # the rotated queries went to q8 only
    qn = q_before.float() * torch.rsqrt(q_before.float().pow(2).mean(-1, keepdim=True) + 1e-6)
    rotated = apply_rope(qn.bfloat16() * norms[0], positions, freqs).bfloat16()
    assert torch.equal(q8.float(), (rotated.float() * mult[None, :, None]).to(FP8_DTYPE).float())
    for w, r in zip(window, ring, strict=True):
        assert torch.equal(w[:, T : 2 * T].view(torch.uint8), r[:, 2 * T : 3 * T].view(torch.uint8))
        assert (w[:, :T].float() == 7).all() and (w[:, 2 * T :].float() == 7).all()


def test_window_splits_without_the_fp8_window_are_refused():
    with pytest.raises(ValueError, match="diffusion.step.window_splits: splits the FP8 window's keys: it needs diffusion.step.attention"):
        StepOptions(fused=True, window_splits=4)
    with pytest.raises(ValueError, match="diffusion.step.attention: must be one of ring, gathered, fp8_window"):
        StepOptions(attention="fp8")


@pytest.mark.parametrize("fused", [True, False])
def test_the_fp8_window_is_refused_where_it_cannot_run(fused):
    with pytest.raises(ValueError, match="step.attention 'fp8_window' needs the fused step on CUDA"):
        Generator(TINY, None, "cpu", options=StepOptions(fused=fused, attention="fp8_window"))
