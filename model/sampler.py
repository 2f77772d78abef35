"""Few-step flow-matching sampler: 4 fixed noise levels per latent frame, seeded.

Convention (rectified flow): x_sigma = (1 - sigma) * x0 + sigma * noise and the model predicts the
velocity v = noise - x0. Sampling starts from pure noise at sigma = levels[0] = 1 and takes one
Euler step per level down to 0; the pass at the last level writes the K/V that stay as context.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch


def seeded_noise(shape: Sequence[int], seed: int) -> torch.Tensor:
    """Standard normal noise drawn on the CPU from ``seed``: identical on every device and TP rank."""
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed))


def sample(velocity: Callable[[torch.Tensor, float], torch.Tensor], noise: torch.Tensor, levels: Sequence[float]) -> torch.Tensor:
    """Integrate from ``noise`` at ``levels[0]`` to sigma = 0 with one model pass per level."""
    x = noise
    for sigma, next_sigma in zip(levels, [*levels[1:], 0.0], strict=True):
        x = x + (next_sigma - sigma) * velocity(x, sigma).float()
    return x


def noised(x0: torch.Tensor, noise: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """x_sigma for a per-frame sigma broadcastable from the left: (B, F) against (B, F, C, h, w)."""
    s = sigma.reshape(*sigma.shape, *([1] * (x0.dim() - sigma.dim())))
    return (1 - s) * x0 + s * noise
