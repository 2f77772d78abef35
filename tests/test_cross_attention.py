"""The cross-attention kernel's reference and its refusals on the CPU (the Triton kernel against the
reference: tests/test_kernels_triton.py through the interpreter, tests/test_kernels_gpu.py on the GPU)."""

from __future__ import annotations

import pytest
import torch

from charstream.kernels.cross_attention import MAX_KEYS, cross_attention
from charstream.model.dit import _cross_attention


def test_reference_is_the_models_cross_attention_per_head_in_place():
    g = torch.Generator().manual_seed(0)
    fused = torch.randn(20, 4 * 3 * 16, generator=g)
    cq = fused[:, 3 * 48 :].unflatten(-1, (3, 16))
    k, v = torch.randn(3, 9, 16, generator=g), torch.randn(3, 9, 16, generator=g)
    want = _cross_attention(cq.transpose(0, 1).clone(), k, v).transpose(0, 1)
    got = cross_attention(cq, k, v, cq)  # the CPU dispatch: the reference, in place
    assert got.data_ptr() == cq.data_ptr() and torch.allclose(cq, want, atol=1e-6)


def test_bad_shapes_are_refused():
    q = torch.zeros(4, 2, 8)
    with pytest.raises(ValueError, match="need q and out"):
        cross_attention(q, torch.zeros(3, 5, 8), torch.zeros(3, 5, 8), q)
    with pytest.raises(ValueError, match="keys"):
        cross_attention(q, torch.zeros(2, MAX_KEYS + 1, 8), torch.zeros(2, MAX_KEYS + 1, 8), q)
    with pytest.raises(ValueError, match="contiguous last"):
        cross_attention(q, torch.zeros(2, 8, 5).transpose(1, 2), torch.zeros(2, 5, 8), q)
