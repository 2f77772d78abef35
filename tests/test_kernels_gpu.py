"""The Triton kernels and FP8 GEMMs against their PyTorch references on the GPU, at the shapes of one
TP=4 shard of characters-57b (15 heads x 128, 757 tokens per frame), on fresh random inputs, with
poisoned outputs. Skipped without CUDA.

Tolerances: a stored FP8 value may differ from the reference's by one e4m3 step (fp32 arithmetic
in a different order can round the other way: 2^-3 relative, 2^-9 absolute near zero) in under 1%
of elements; bf16 outputs by bf16 rounding (rel. norm < 1e-2); attention over FP8 K/V against the
fp32 reference over the same stored values by fp16/bf16 rounding of q and p (< 2e-2).
"""

from __future__ import annotations

import pytest
import torch

from charstream.kernels.adaln_quant import adaln_quant_reference, adaln_quant_triton
from charstream.kernels.attention_merge import merge_partials_reference, merge_partials_triton
from charstream.kernels.cross_attention import cross_attention_reference, cross_attention_triton
from charstream.kernels.delta_rotate import delta_rotate_reference, delta_rotate_triton
from charstream.kernels.fp8 import FP8_DTYPE
from charstream.kernels.quantize_rows import quantize_rows_reference, quantize_rows_triton
from charstream.kernels.ring_attention import (
    gather_window,
    ring_attention_reference,
    ring_attention_triton,
    window_attention,
)
from charstream.kernels.ring_write import (
    ring_write_prep_reference,
    ring_write_prep_triton,
    ring_write_reference,
    ring_write_triton,
    rope_table,
)
from charstream.kernels.rope import rope_freqs
from charstream.model.fp8_linear import Fp8Linear
from charstream.model.rope import frame_positions

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

H, D, T, GRID, AUDIO = 15, 128, 757, (22, 34), 9
SINK, RING = T, 10
N_SLOTS = SINK + RING * T


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _assert_fp8_close(got: torch.Tensor, ref: torch.Tensor) -> None:
    g, r = got.float(), ref.float()
    assert not torch.isnan(g).any()
    step = 0.125 * torch.maximum(g.abs(), r.abs()) + 2.0**-9
    assert ((g - r).abs() <= step).all(), "an FP8 value differs by more than one e4m3 step"
    assert (g != r).float().mean() < 0.01


def _poisoned(shape, dtype) -> torch.Tensor:
    return torch.full(shape, 300.0 if dtype == FP8_DTYPE else 1e4, device="cuda").to(dtype)


@pytest.mark.parametrize("dtype", [FP8_DTYPE, torch.bfloat16])
def test_ring_write(dtype):
    freqs = rope_freqs(D, "cuda")
    k_new, v_new = (torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16) * 3 for _ in range(2))
    positions = frame_positions(17, GRID, AUDIO, "cuda")
    k_scale, v_scale = (torch.rand(H, device="cuda") * 0.02 + 0.01 for _ in range(2))
    slot = SINK + 6 * T
    ref = [_poisoned((H, N_SLOTS, D), dtype) for _ in range(2)]
    got = [_poisoned((H, N_SLOTS, D), dtype) for _ in range(2)]
    ring_write_reference(*ref, k_scale, v_scale, k_new, v_new, slot, positions, freqs)
    ring_write_triton(*got, k_scale, v_scale, k_new, v_new, torch.tensor(slot, device="cuda"), positions, freqs)
    for g, r in zip(got, ref, strict=True):
        if dtype == FP8_DTYPE:
            _assert_fp8_close(g, r)
        else:
            assert _rel(g[:, slot : slot + T], r[:, slot : slot + T]) < 1e-2
        untouched = torch.ones(N_SLOTS, dtype=torch.bool, device="cuda")
        untouched[slot : slot + T] = False
        assert (g[:, untouched].float() == r[:, untouched].float()).all()  # still the poison
        assert (g[:, slot : slot + T].float() != _poisoned((1,), dtype).float()).any()


def test_ring_write_prep():
    freqs = rope_freqs(D, "cuda")
    fused = torch.randn(T, 4 * H * D, device="cuda", dtype=torch.bfloat16) * 3
    positions = frame_positions(17, GRID, AUDIO, "cuda")
    # scales small enough that some values saturate: the count is checked too
    k_scale, v_scale = (torch.rand(H, device="cuda") * 0.004 + 0.004 for _ in range(2))
    norms = tuple(torch.rand(D, device="cuda") + 0.5 for _ in range(3))
    slot = SINK + 3 * T
    # the kernel also writes the dequantized K/V into window slots [2T, 3T) of a poisoned bf16 window
    window = tuple(_poisoned((H, SINK + 7 * T, D), torch.bfloat16) for _ in range(2))
    runs = []
    for prep, at, win in ((ring_write_prep_reference, slot, None),
                          (ring_write_prep_triton, torch.tensor(slot, device="cuda"),
                           (*window, torch.tensor(2 * T, device="cuda")))):
        buf = fused.clone()
        q, k, v, cq = (buf[:, i * H * D : (i + 1) * H * D].unflatten(-1, (H, D)) for i in range(4))
        caches = [_poisoned((H, N_SLOTS, D), FP8_DTYPE) for _ in range(2)]
        saturated = torch.zeros((), dtype=torch.int64, device="cuda")
        prep(q, k, v, cq, *caches, k_scale, v_scale, at, positions, freqs, norms, saturated, window=win)
        runs.append((q, cq, *caches, saturated))
    (rq, rcq, rk, rv, rsat), (gq, gcq, gk, gv, gsat) = runs
    for w, c, scale in zip(window, (gk, gv), (k_scale, v_scale), strict=True):  # as gather_window dequantizes
        assert torch.equal(w[:, 2 * T : 3 * T], (c[:, slot : slot + T].float() * scale[:, None, None]).to(torch.bfloat16))
        assert (w[:, : 2 * T] == 1e4).all() and (w[:, 3 * T :] == 1e4).all()
    assert _rel(gq, rq) < 1e-2 and _rel(gcq, rcq) < 1e-2
    _assert_fp8_close(gv, rv)
    # K: the reference rounds the normed keys to bf16 before RoPE (as the model does), the kernel stays
    # in fp32, so a rotated pair's small component can land an FP8 step or two away (measured on the
    # H200: 1.4% of the written values beyond one step, 2.4% differing; 1.04e-2 relative over the
    # written keys with these saturating scales)
    written = slice(slot, slot + T)
    g, r = gk[:, written].float(), rk[:, written].float()
    assert _rel(g * k_scale[:, None, None], r * k_scale[:, None, None]) < 2e-2
    assert ((g - r).abs() > 0.125 * torch.maximum(g.abs(), r.abs()) + 2.0**-9).float().mean() < 0.03
    assert rsat.item() > 0 and abs(gsat.item() - rsat.item()) <= 0.01 * rsat.item()


def test_ring_write_prep_without_the_ring_write_does_the_rest():
    """The prep with the ring's stores compiled out (bench gpu's measure of the write's cost inside the prep):
    the ring keeps its poison, and q, cq, the window and the saturation count are bit-equal to the full prep's."""
    from charstream.pipeline.bench.gpu import prep_without_ring_write

    freqs = rope_freqs(D, "cuda")
    fused = torch.randn(T, 4 * H * D, device="cuda", dtype=torch.bfloat16) * 3
    positions = frame_positions(17, GRID, AUDIO, "cuda")
    k_scale, v_scale = (torch.rand(H, device="cuda") * 0.004 + 0.004 for _ in range(2))
    norms = tuple(torch.rand(D, device="cuda") + 0.5 for _ in range(3))
    slot = torch.tensor(SINK + 3 * T, device="cuda")
    runs = []
    for write_ring in (True, False):
        buf = fused.clone()
        q, k, v, cq = (buf[:, i * H * D : (i + 1) * H * D].unflatten(-1, (H, D)) for i in range(4))
        caches = [_poisoned((H, N_SLOTS, D), FP8_DTYPE) for _ in range(2)]
        window = [_poisoned((H, SINK + 7 * T, D), torch.bfloat16) for _ in range(2)]
        saturated = torch.zeros((), dtype=torch.int64, device="cuda")
        prep = ring_write_prep_triton if write_ring else prep_without_ring_write
        prep(q, k, v, cq, *caches, k_scale, v_scale, slot, positions, freqs, norms, saturated,
             rotation=rope_table(positions, freqs), window=(*window, torch.tensor(2 * T, device="cuda")))
        runs.append(((q, cq, *window, saturated), caches))
    (full, full_ring), (bare, bare_ring) = runs
    poison = _poisoned((1,), FP8_DTYPE).float()
    assert all((c.float() == poison).all() for c in bare_ring)
    assert all((c[:, SINK + 3 * T : SINK + 4 * T].float() != poison).any() for c in full_ring)
    assert (full[2][:, 2 * T : 3 * T] != 1e4).all()  # the window was written
    assert all(torch.equal(a, b) for a, b in zip(full, bare, strict=True))


@pytest.mark.parametrize("dtype", [FP8_DTYPE, torch.bfloat16])
@pytest.mark.parametrize("programs", [None, 7])  # one per SM; 7: most tiles split across programs
def test_ring_attention(dtype, programs):
    k_cache, v_cache = ((torch.randn(H, N_SLOTS, D, device="cuda") * 100).clamp(-448, 448).to(dtype) for _ in range(2))
    k_scale, v_scale = (torch.rand(H, device="cuda") * 0.02 + 0.005 for _ in range(2))
    if dtype != FP8_DTYPE:
        k_scale, v_scale = torch.ones_like(k_scale), torch.ones_like(v_scale)
        k_cache, v_cache = k_cache / 100, v_cache / 100
    ring_valid = torch.rand(RING, device="cuda") < 0.7
    ring_valid[0] = False
    q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
    ref = ring_attention_reference(q, k_cache, v_cache, k_scale, v_scale, ring_valid, SINK, T)
    buf = torch.full((T, 2 * H, D), float("nan"), device="cuda", dtype=torch.bfloat16)
    out = ring_attention_triton(q, k_cache, v_cache, k_scale, v_scale, ring_valid, SINK, T, out=buf[:, H:],
                                programs=programs)
    assert not torch.isnan(out).any()
    assert torch.isnan(buf[:, :H]).all()
    assert _rel(out, ref) < 2e-2


def test_window_gathered_over_listed_frames_then_attended():
    k_cache, v_cache = ((torch.randn(H, N_SLOTS, D, device="cuda") * 100).clamp(-448, 448).to(FP8_DTYPE) for _ in range(2))
    k_scale, v_scale = (torch.rand(H, device="cuda") * 0.02 + 0.005 for _ in range(2))
    order = torch.randperm(RING)[:7].to(torch.int32).cuda()  # the window's frames, in any ring order
    ring_valid = torch.zeros(RING, dtype=torch.bool, device="cuda")
    ring_valid[order.long()] = True
    q = torch.randn(T, H, D, device="cuda", dtype=torch.bfloat16)
    ref = ring_attention_reference(q, k_cache, v_cache, k_scale, v_scale, ring_valid, SINK, T)
    window = tuple(torch.full((H, SINK + 7 * T, D), float("nan"), device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = torch.full_like(q, float("nan"))
    window_attention(q, *gather_window(k_cache, v_cache, k_scale, v_scale, order, SINK, T, window), out)
    assert not torch.isnan(out).any() and not torch.isnan(window[0]).any()
    assert _rel(out, ref) < 2e-2


@pytest.mark.parametrize("dtype", [FP8_DTYPE, torch.bfloat16])
def test_delta_rotate(dtype):
    freqs = rope_freqs(D, "cuda")
    k_all = (torch.randn(4, H, N_SLOTS, D, device="cuda") * 60).clamp(-448, 448).to(dtype)
    k_scale = torch.rand(4, H, device="cuda") * 0.02 + 0.01
    ref, got = k_all.clone(), k_all.clone()
    skip = (SINK + 4 * T, T)  # the frame at ring position 4: about to be overwritten, left alone
    delta_rotate_reference(ref, k_scale, 42, freqs.t, SINK, skip)
    delta_rotate_triton(got, k_scale, torch.tensor(42, device="cuda"), freqs.t, SINK, skip)
    if dtype == FP8_DTYPE:
        _assert_fp8_close(got, ref)
    else:
        assert _rel(got, ref) < 1e-2
    assert (got[:, :, :SINK].float() == k_all[:, :, :SINK].float()).all()
    assert (got[:, :, skip[0] : sum(skip)].float() == k_all[:, :, skip[0] : sum(skip)].float()).all()
    assert (got[..., 44:].float() == k_all[..., 44:].float()).all()
    assert (got[:, :, SINK : skip[0], :44].float() != k_all[:, :, SINK : skip[0], :44].float()).float().mean() > 0.5


@pytest.mark.parametrize(("act_from", "cols"), [(None, 9600), (1920, 9600), (3000, 20000)])
def test_quantize_rows(act_from, cols):
    # 9600 columns: the one-sweep path (the row in registers); 20000: two sweeps
    x = torch.randn(T, cols, device="cuda", dtype=torch.bfloat16) * torch.rand(T, 1, device="cuda") * 10
    xq, scale = quantize_rows_triton(x, act_from)
    rq, rscale = quantize_rows_reference(x, act_from)
    assert torch.allclose(scale, rscale, rtol=1e-5)
    _assert_fp8_close(xq, rq)


@pytest.mark.parametrize("prefix_select", [False, True])  # per-element pointers (served); values selected
@pytest.mark.parametrize("cols", [15360, 20000])  # the TP=3 [attn | cross | mlp] row (one sweep); two sweeps
def test_quantize_rows_reads_the_leading_columns_from_the_prefix(cols, prefix_select):
    """The full-window step's GELU rows: the attention columns from cuDNN's own output buffer. x's
    columns there are NaN, so reading them would show."""
    hd = 2560
    # bf16 as served (a float32 factor would promote x, and the kernel refuses a prefix of another dtype)
    x = torch.randn(T, cols, device="cuda", dtype=torch.bfloat16) * torch.rand(T, 1, device="cuda").bfloat16() * 10
    attn = torch.randn(T, 20, 128, device="cuda", dtype=torch.bfloat16) * 4  # (tokens, heads, D) as cuDNN leaves it
    poisoned = x.clone()
    poisoned[:, :hd] = float("nan")
    out = (_poisoned((T, cols), FP8_DTYPE), torch.full((T, 1), float("nan"), device="cuda"))
    xq, scale = quantize_rows_triton(poisoned, 2 * hd, out, prefix=attn.flatten(1), prefix_select=prefix_select)
    rq, rscale = quantize_rows_reference(torch.cat([attn.flatten(1), x[:, hd:]], dim=1), 2 * hd)
    assert torch.allclose(scale, rscale, rtol=1e-5)
    _assert_fp8_close(xq, rq)


@pytest.mark.parametrize("cols", [15360, 20000])
def test_quantize_rows_reads_an_fp8_prefix_with_its_scales_per_head(cols):
    """The FP8 window attention's output: e4m3 codes (tokens, heads, D), one scale per head."""
    hd = 2560
    x = torch.randn(T, cols, device="cuda", dtype=torch.bfloat16) * torch.rand(T, 1, device="cuda").bfloat16() * 10
    codes = (torch.randn(T, 20, 128, device="cuda") * 60).clamp(-448, 448).to(FP8_DTYPE)
    head_scale = torch.rand(20, device="cuda") * 0.1 + 0.01
    poisoned = x.clone()
    poisoned[:, :hd] = float("nan")
    out = (_poisoned((T, cols), FP8_DTYPE), torch.full((T, 1), float("nan"), device="cuda"))
    xq, scale = quantize_rows_triton(poisoned, 2 * hd, out, prefix=codes.flatten(1), prefix_scale=head_scale)
    real = (codes.float() * head_scale[None, :, None]).flatten(1)
    rq, rscale = quantize_rows_reference(torch.cat([real, x[:, hd:].float()], dim=1), 2 * hd)
    assert torch.allclose(scale, rscale, rtol=1e-5)
    _assert_fp8_close(xq, rq)
    gq, gscale = quantize_rows_reference(poisoned, 2 * hd, prefix=codes.flatten(1), prefix_scale=head_scale)
    assert torch.allclose(gscale, rscale) and torch.equal(gq.float(), rq.float())  # the reference's own prefix path


def test_ring_write_prep_writes_q_codes_and_an_fp8_window():
    """The FP8 window attention's prep: the ring's codes into an FP8 window, q's e4m3 codes (times a
    per-head multiplier) into their own buffer, q itself left as it was."""
    freqs = rope_freqs(D, "cuda")
    fused = torch.randn(T, 4 * H * D, device="cuda", dtype=torch.bfloat16) * 3
    positions = frame_positions(17, GRID, AUDIO, "cuda")
    k_scale, v_scale = (torch.rand(H, device="cuda") * 0.01 + 0.01 for _ in range(2))
    norms = tuple(torch.rand(D, device="cuda") + 0.5 for _ in range(3))
    mult = torch.rand(H, device="cuda") * 10 + 5  # codes up to ~|q| x 15: well inside e4m3's range
    slot = SINK + 3 * T
    runs = []
    for prep, at in ((ring_write_prep_reference, slot), (ring_write_prep_triton, torch.tensor(slot, device="cuda"))):
        buf = fused.clone()
        q, k, v, cq = (buf[:, i * H * D : (i + 1) * H * D].unflatten(-1, (H, D)) for i in range(4))
        caches = [_poisoned((H, N_SLOTS, D), FP8_DTYPE) for _ in range(2)]
        window = tuple(_poisoned((H, SINK + 7 * T, D), FP8_DTYPE) for _ in range(2))
        q8 = _poisoned((T, H, D), FP8_DTYPE)
        saturated = torch.zeros((), dtype=torch.int64, device="cuda")
        prep(q, k, v, cq, *caches, k_scale, v_scale, at, positions, freqs, norms, saturated,
             window=(*window, 2 * T if prep is ring_write_prep_reference else torch.tensor(2 * T, device="cuda")),
             q8=(q8, mult))
        runs.append((q, q8, caches, window))
    (rq, rq8, _, _), (gq, gq8, gcaches, gwindow) = runs
    assert torch.equal(gq, fused[:, : H * D].unflatten(-1, (H, D))) and torch.equal(rq, gq)  # q not written
    # as for K in test_ring_write_prep: the reference rounds the normed queries to bf16 before RoPE, the
    # kernel after, so a rotated pair's small component can land a step or two away
    g, r = gq8.float() / mult[None, :, None], rq8.float() / mult[None, :, None]
    assert not torch.isnan(g).any() and _rel(g, r) < 4e-2
    assert ((g - r).abs() > 0.125 * torch.maximum(g.abs(), r.abs()) + 2.0**-9 / 5).float().mean() < 0.03
    for w, c in zip(gwindow, gcaches, strict=True):  # the codes as the ring stores them, nothing else written
        assert torch.equal(w[:, 2 * T : 3 * T].view(torch.uint8), c[:, slot : slot + T].view(torch.uint8))
        poison = _poisoned((1,), FP8_DTYPE).float()
        assert (w[:, : 2 * T].float() == poison).all() and (w[:, 3 * T :].float() == poison).all()


def test_fp8_window_attention_matches_its_reference():
    """cuDNN's FP8 SDPA over e4m3 codes against fp32 math over the same codes' values. Stated
    tolerance: cuDNN stores the probabilities and the output in e4m3 (3 mantissa bits), so over
    near-uniform attention (random keys, 6,056 of them) the relative error is a few percent (3.7e-2
    measured on the H200 at TP=3 shapes, and the same from an emulation of those two roundings on the
    CPU); with peaked attention it is smaller. The output is poisoned first. (A real output far below
    e4m3's normal range, 2^-6, would be subnormal codes: the step keeps it in V's code units.)"""
    from charstream.kernels.fp8_window_attention import Fp8WindowAttention, fp8_window_attention_reference

    n_keys = SINK + 7 * T
    q8 = (torch.randn(T, H, D, device="cuda") * 40).clamp(-448, 448).to(FP8_DTYPE)
    k8, v8 = ((torch.randn(H, n_keys, D, device="cuda") * 80).clamp(-448, 448).to(FP8_DTYPE) for _ in range(2))
    # one key per query block made to dominate: attention from uniform to peaked within one call
    k8[:, :T] = (q8.float().transpose(0, 1) * 3).clamp(-448, 448).to(FP8_DTYPE)
    # as the step calls it: K's scales folded into q's codes, V and the output in V's code units
    descale_q = torch.rand(1, device="cuda") * 0.01 + 0.002
    descale_k = descale_v = torch.ones(1, device="cuda")
    scale_o = torch.full((1,), 0.5, device="cuda")
    attn = Fp8WindowAttention(H, T, n_keys, D, q8.stride(), D**-0.5)
    out8 = torch.full((T, H, D), float("nan"), device="cuda").to(FP8_DTYPE)
    attn(q8, k8, v8, descale_q, descale_k, descale_v, scale_o, out8)
    got = out8.float() / scale_o
    ref = fp8_window_attention_reference(q8, k8, v8, descale_q, descale_k, descale_v, D**-0.5)
    assert not torch.isnan(got).any()
    assert _rel(got, ref) < 6e-2
    with pytest.raises(ValueError, match="do not match"):
        attn(q8[:-1], k8, v8, descale_q, descale_k, descale_v, scale_o, out8)


@pytest.mark.parametrize(("rows", "num_warps"), [(1, None), (1, 16), (2, 16)])  # None: the default
@pytest.mark.parametrize("with_residual", [True, False])
def test_adaln_quant(rows, num_warps, with_residual):
    dim = 7680
    x = torch.randn(T, dim, device="cuda", dtype=torch.bfloat16) * 3
    residual = torch.randn(T, dim, device="cuda", dtype=torch.bfloat16) * torch.rand(T, 1, device="cuda") * 4
    shift, scale, gate = (torch.randn(dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    res = (residual, gate) if with_residual else (None, None)
    x_ref, x_got = x.clone(), x.clone()
    rq, rscale = adaln_quant_reference(x_ref, shift, scale, *res)
    out = (torch.full((T, dim), 300.0, device="cuda").to(FP8_DTYPE), torch.full((T, 1), float("nan"), device="cuda"))
    adaln_quant_triton(x_got, shift, scale, *res, out=out, rows=rows, num_warps=num_warps)
    # the residual update: the same fp32 sum rounded to bf16 (a fused multiply-add may round once less)
    assert _rel(x_got, x_ref) < 1e-3 and (x_got != x_ref).float().mean() < 1e-3
    if with_residual:  # the codes of the stream as the kernel stored it: one bf16 step of an element near
        # its row's mean moves its small code by several FP8 steps (the test failed 3-5 runs in 8 that way)
        rq, rscale = adaln_quant_reference(x_got.clone(), shift, scale)
    assert torch.allclose(out[1], rscale, rtol=1e-4)
    _assert_fp8_close(out[0], rq)


def test_attention_merge():
    """The split window's merge of 4 partitions at the shard's shape into the third column block of a
    NaN-poisoned (T, 5 H D) bf16 buffer: every finite e4m3 code (random bytes but NaN's), log-sum-exps
    spread enough that some partitions' weights vanish and others dominate."""
    s = 4
    bits = torch.randint(0, 0x7F, (s, T, H, D), device="cuda", dtype=torch.uint8)  # 0x7F: e4m3's NaN
    bits |= torch.randint(0, 2, bits.shape, device="cuda", dtype=torch.uint8) << 7
    parts = bits.view(FP8_DTYPE)
    lse = torch.randn(s, H, T, device="cuda") * 4 + 20
    head_scale = torch.rand(H, device="cuda") * 0.01 + 0.001
    inside = slice(2 * H * D, 3 * H * D)
    merged = []
    for merge in (merge_partials_reference, merge_partials_triton):
        buf = torch.full((T, 5 * H * D), float("nan"), device="cuda", dtype=torch.bfloat16)
        merge(parts, lse, head_scale, buf[:, inside].unflatten(-1, (H, D)))
        merged.append(buf)
    ref, got = merged
    assert not torch.isnan(got[:, inside]).any()
    assert _rel(got[:, inside], ref[:, inside]) < 1e-2  # the same fp32 math, each rounded to bf16
    outside = torch.ones(5 * H * D, dtype=torch.bool, device="cuda")
    outside[inside] = False
    assert torch.isnan(got[:, outside]).all()


def test_cross_attention_in_place():
    """The cross-attention over 9 audio keys in place over the cross-q columns of a (T, 5 H D) bf16 buffer
    against fp32 math: bf16 probabilities and output (< 1e-2), the other columns untouched."""
    fused = torch.randn(T, 5 * H * D, device="cuda", dtype=torch.bfloat16)
    before = fused.clone()
    cq = fused[:, 3 * H * D : 4 * H * D].unflatten(-1, (H, D))
    kv = torch.randn(9, 2, H, D, device="cuda", dtype=torch.bfloat16)
    k, v = kv[:, 0].transpose(0, 1), kv[:, 1].transpose(0, 1)  # (H, 9, D) views, as the step's cross K/V
    want = cross_attention_reference(cq, k, v, torch.empty(T, H, D, device="cuda"))
    cross_attention_triton(cq, k, v, cq)
    assert _rel(cq, want) < 1e-2
    assert torch.equal(fused[:, : 3 * H * D], before[:, : 3 * H * D])
    assert torch.equal(fused[:, 4 * H * D :], before[:, 4 * H * D :])


def test_fp8_linear_matches_bf16_matmul():
    w = torch.randn(2048, 7680, device="cuda") * 0.02
    x = torch.randn(T, 7680, device="cuda", dtype=torch.bfloat16)
    layer = Fp8Linear.from_weight(w)
    ref = x.float() @ w.t()
    assert _rel(layer(x), ref) < 0.06  # two e4m3 operands: ~3-4% per product, averaged over 7680
    exact = Fp8Linear.from_weight(w, fast_accum=False)
    assert _rel(exact(x), ref) < 0.06
