"""The split-window attention merge's reference on the CPU: merging the partitions' outputs by their
log-sum-exps is attention over the union of their keys; the formula in float64; the contract's
refusals; nothing outside ``out``'s view written. The Triton kernel against this reference: through
Triton's interpreter (tests/test_kernels_triton.py) and on the GPU (tests/test_kernels_gpu.py)."""

from __future__ import annotations

import pytest
import torch

from charstream.kernels.attention_merge import merge_partials, merge_partials_reference
from charstream.kernels.fp8 import FP8_DTYPE, FP8_MAX
from charstream.kernels.fp8_window_attention import (
    fp8_window_attention_reference,
    fp8_window_partials_reference,
)

H, D, T, N = 3, 16, 12, 64


def _codes(*shape: int) -> torch.Tensor:
    return (torch.randn(*shape) * 50).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _out_view(n_tokens: int = T, poison: float = float("nan")) -> tuple[torch.Tensor, torch.Tensor]:
    """A poisoned (T, 5 H D) buffer and its third (T, H, D) column block, as the step's fused buffer."""
    buf = torch.full((n_tokens, 5 * H * D), poison, dtype=torch.bfloat16)
    return buf, buf[:, 2 * H * D : 3 * H * D].unflatten(-1, (H, D))


def test_merge_of_the_partitions_is_attention_over_all_keys():
    """4 partitions of 16 keys each: their partial outputs and log-sum-exps
    (fp8_window_partials_reference), the partials stored as e4m3 codes with a scale per head
    (amax / 448), merged; against the attention over all 64 keys. The only error is the e4m3 rounding
    of the partials (each code within 2^-4 relative or 2^-10 absolute, below e4m3's normal range):
    checked element-wise through that bound, and as a relative Frobenius norm < 4e-2 (2.7% mean,
    3.3% max, sd 0.2% over 1,000 draws of these inputs: near-uniform attention, where the merged
    output is about half a partial's size, so the partials' rounding weighs double)."""
    s = 4
    q8, k8, v8 = _codes(T, H, D), _codes(H, N, D), _codes(H, N, D)
    dq, dk, dv, sm = torch.tensor([0.01]), torch.tensor([0.02]), torch.tensor([0.03]), D**-0.5
    full = fp8_window_attention_reference(q8, k8, v8, dq, dk, dv, sm)
    partials, lse = fp8_window_partials_reference(q8, k8, v8, dq, dk, dv, sm, s)  # lse (S, H, T), natural log
    head_scale = partials.abs().amax(dim=(0, 1, 3)) / FP8_MAX
    parts = (partials / head_scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    _, out = _out_view()
    assert merge_partials_reference(parts, lse, head_scale, out) is out
    assert _rel(out, full) < 4e-2
    # element-wise: the partials' rounding bound merged with the same weights, + the bf16 store
    w = torch.softmax(lse.double(), 0).transpose(1, 2)[..., None]  # (S, T, H, 1), normalised weights
    rounding = (w * (2.0**-4 * partials.double().abs() + 2.0**-10 * head_scale[:, None].double())).sum(0)
    bound = (1 + 2.0**-8) * rounding + 2.0**-8 * full.double().abs() + 1e-6 * head_scale[:, None].double()
    assert ((out.double() - full.double()).abs() <= bound).all()


@pytest.mark.parametrize("s", [1, 2, 3, 4])
def test_reference_is_the_formula_in_float64(s):
    """Codes that are exactly e4m3 (integers in [-16, 16]) and log-sum-exps around 100 (exp(100)
    overflows fp32: the max is subtracted first): the fp32 result within one bf16 rounding (2^-9
    relative, 2^-8 allowed) of the formula in float64, plus fp32's rounding of the sums."""
    parts = torch.randint(-16, 17, (s, T, H, D)).float().to(FP8_DTYPE)
    lse = torch.randn(s, H, T) * 3 + 100
    head_scale = torch.rand(H) * 0.1 + 0.01
    _, out = _out_view()
    merge_partials_reference(parts, lse, head_scale, out)
    w = torch.exp(lse.double() - lse.double().amax(0)).transpose(1, 2)[..., None]  # (S, T, H, 1)
    want = head_scale.double()[:, None] * (w * parts.double()).sum(0) / w.sum(0)
    assert not torch.isnan(out).any()
    assert ((out.double() - want).abs() <= 2.0**-8 * want.abs() + 1e-5 * head_scale.double()[:, None]).all()
    if s == 1:  # one partition: its weight is exactly 1, the output its codes times the scale
        assert torch.equal(out, (parts[0].float() * head_scale[:, None]).bfloat16())


def test_an_empty_partition_weighs_nothing():
    """A partition without keys (lse -inf) adds nothing: the merge of the other partitions."""
    parts = _codes(3, T, H, D)
    lse = torch.randn(3, H, T)
    head_scale = torch.rand(H) + 0.1
    lse[1] = float("-inf")
    _, got = _out_view()
    _, want = _out_view()
    merge_partials_reference(parts, lse, head_scale, got)
    merge_partials_reference(parts[[0, 2]].contiguous(), lse[[0, 2]].contiguous(), head_scale, want)
    assert torch.equal(got, want)


def test_the_reference_writes_only_the_view():
    parts, lse, head_scale = _codes(2, T, H, D), torch.randn(2, H, T), torch.rand(H) + 0.1
    buf, out = _out_view(poison=float("nan"))
    merge_partials(parts, lse, head_scale, out)  # the dispatcher on CPU tensors: the reference
    assert not torch.isnan(out).any()
    outside = torch.ones(5 * H * D, dtype=torch.bool)
    outside[2 * H * D : 3 * H * D] = False
    assert torch.isnan(buf[:, outside]).all()


def _valid() -> dict[str, torch.Tensor]:
    return {"parts": _codes(2, T, H, D), "lse": torch.randn(2, H, T), "head_scale": torch.rand(H) + 0.1,
            "out": _out_view()[1]}


@pytest.mark.parametrize(("name", "bad", "match"), [
    ("parts", lambda a: a["parts"].float(), "parts must be contiguous"),
    ("parts", lambda a: a["parts"].transpose(2, 3).contiguous().transpose(2, 3), "parts must be contiguous"),
    ("parts", lambda a: a["parts"][0], "parts must be contiguous"),
    ("parts", lambda a: a["parts"][:0], "at least one partition"),
    ("parts", lambda a: _codes(2, T, H, 12), "power of two"),
    ("lse", lambda a: a["lse"].double(), "lse must be"),
    ("lse", lambda a: torch.randn(2, T, H), "lse must be"),
    ("lse", lambda a: torch.randn(2, T, H).transpose(1, 2), "lse must be"),
    ("head_scale", lambda a: a["head_scale"].bfloat16(), "head_scale must be"),
    ("head_scale", lambda a: torch.rand(H + 1), "head_scale must be"),
    ("out", lambda a: a["out"].float(), "out must be"),
    ("out", lambda a: a["out"][:-1], "out must be"),
    ("out", lambda a: torch.empty(T, D, H, dtype=torch.bfloat16).transpose(1, 2), "out needs strides"),
    ("out", lambda a: torch.empty(T, H, 2 * D, dtype=torch.bfloat16)[..., :D], "out needs strides"),
    ("out", lambda a: torch.empty(H, D, dtype=torch.bfloat16).expand(T, H, D), "out needs strides"),  # rows overlap
])
def test_invalid_inputs_are_refused(name, bad, match):
    args = _valid()
    args[name] = bad(args)
    with pytest.raises(ValueError, match=match):
        merge_partials_reference(**args)
