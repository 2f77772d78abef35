"""FP8 weight GEMMs: ``y = x @ W^T`` with W stored float8_e4m3fn and one float32 scale per output
feature, activations quantized per row on the fly (``kernels/quantize_rows``).

On CUDA the product is one ``torch._scaled_mm`` with row-wise scales (A: one scale per token,
B: one per output feature), accumulating in fp32 and writing bf16. On the CPU it falls back to a
plain matmul on the dequantized weights in the activation's dtype (the tiny model's path), so the
same module serves both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from charstream.kernels.fp8 import FP8_DTYPE, FP8_MAX
from charstream.kernels.quantize_rows import quantize_rows


def quantize_weight(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, in) weight -> (fp8 weight, float32 per-output-row scale (out,))."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / FP8_MAX
    return (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale


class Fp8Linear(nn.Module):
    """A linear layer whose weight lives in FP8 with per-output-feature scales (no bias)."""

    def __init__(self, weight_fp8: torch.Tensor, scale: torch.Tensor, fast_accum: bool = True) -> None:
        super().__init__()
        if weight_fp8.dtype != FP8_DTYPE or scale.shape != weight_fp8.shape[:1]:
            raise ValueError("Fp8Linear needs an fp8 (out, in) weight and a float32 (out,) scale")
        out_features, in_features = weight_fp8.shape
        if in_features % 16 or out_features % 16:
            raise ValueError(f"FP8 GEMM needs in/out features divisible by 16, got {in_features}x{out_features}")
        self.register_buffer("weight", weight_fp8)
        self.register_buffer("scale", scale.float().reshape(1, out_features).contiguous())
        self.fast_accum = fast_accum  # Hopper's faster fp8 accumulation (1,315 TFLOP/s at 8192^3 on an H200)

    @classmethod
    def from_weight(cls, weight: torch.Tensor, fast_accum: bool = True) -> Fp8Linear:
        return cls(*quantize_weight(weight), fast_accum=fast_accum)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor, act_from: int | None = None) -> torch.Tensor:
        """x (..., in); ``act_from``: GELU (tanh) on input columns from there on, fused into quantization."""
        rows = x.reshape(-1, self.in_features)
        if x.is_cuda:
            y = self.forward_quantized(*quantize_rows(rows, act_from), out_dtype=x.dtype)
        else:
            if act_from is not None and act_from < self.in_features:
                rows = torch.cat([rows[:, :act_from], F.gelu(rows[:, act_from:], approximate="tanh")], dim=1)
            y = rows @ (self.weight.to(x.dtype) * self.scale.to(x.dtype).t()).t()
        return y.reshape(*x.shape[:-1], self.out_features)

    def forward_quantized(
        self, xq: torch.Tensor, x_scale: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16
    ) -> torch.Tensor:
        """The GEMM on activations already quantized per row: xq (M, in) fp8, x_scale (M, 1) float32."""
        return torch._scaled_mm(
            xq, self.weight.t(), scale_a=x_scale, scale_b=self.scale, out_dtype=out_dtype, use_fast_accum=self.fast_accum
        )
