"""Colour matching of decoded frames to the reference image, as SoulX-FlashHead does every chunk.

Each frame's CIELAB channels (sRGB, D65 white) are shifted and scaled to the reference image's per-channel mean
and standard deviation over the pixels, then converted back to sRGB and blended with the frame by ``strength``
(FlashHead uses 1.0). The corrected last frames are what the next chunk's motion latents are encoded from, so the
match keeps a long stream from drifting in colour.

Frames are ``(B, 3, T, H, W)`` float in [-1, 1] (the VAE's output); the arithmetic runs in float32 whatever their
dtype (the reference implementation runs it in the model's bf16), batched over frames, on the frames' device.
The reference's statistics are computed once per character (``colour_reference``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

# sRGB (linear) -> CIE XYZ, D65, and back.
_XYZ_FROM_RGB = ((0.4124564, 0.3575761, 0.1804375),
                 (0.2126729, 0.7151522, 0.0721750),
                 (0.0193339, 0.1191920, 0.9503041))
_RGB_FROM_XYZ = ((3.2404542, -1.5371385, -0.4985314),
                 (-0.9692660, 1.8760108, 0.0415560),
                 (0.0556434, -0.2040259, 1.0572252))
_WHITE_D65 = (0.95047, 1.0, 1.08883)
_EPSILON = 216 / 24389  # CIE: the linear segment of f below this
_KAPPA = 24389 / 27


def _mix(matrix: tuple[tuple[float, ...], ...], c: Tensor) -> Tensor:
    """``matrix @ c`` over dim 1 (3 channels), as three fused multiply-adds per output channel."""
    return torch.stack([row[0] * c[:, 0] + row[1] * c[:, 1] + row[2] * c[:, 2] for row in matrix], dim=1)


def _white(c: Tensor) -> Tensor:
    return c.new_tensor(_WHITE_D65).view(1, 3, *(1,) * (c.ndim - 2))


def srgb_to_lab(rgb: Tensor) -> Tensor:
    """sRGB in [0, 1] -> CIELAB (L in [0, 100]), channels in dim 1."""
    linear = torch.where(rgb > 0.04045, ((rgb + 0.055) / 1.055) ** 2.4, rgb / 12.92)
    xyz = (_mix(_XYZ_FROM_RGB, linear) / _white(rgb)).clamp(0.0, 1.0)  # >= 0 for the cube root
    f = torch.where(xyz > _EPSILON, xyz ** (1 / 3), (_KAPPA * xyz + 16) / 116)
    fx, fy, fz = f.unbind(1)
    return torch.stack([116 * fy - 16, 500 * (fx - fy), 200 * (fy - fz)], dim=1)


def lab_to_srgb(lab: Tensor) -> Tensor:
    """CIELAB -> sRGB clamped to [0, 1], channels in dim 1."""
    lightness, a, b = lab.unbind(1)
    fy = (lightness + 16) / 116
    f = torch.stack([fy + a / 500, fy, fy - b / 200], dim=1)
    xyz = torch.where(f**3 > _EPSILON, f**3, (116 * f - 16) / _KAPPA)
    # Y from L directly (its linear segment is defined on L), as the standard inverse does.
    y = torch.where(lightness > _KAPPA * _EPSILON, fy**3, lightness / _KAPPA)
    xyz = torch.stack([xyz[:, 0], y, xyz[:, 2]], dim=1) * _white(lab)
    linear = _mix(_RGB_FROM_XYZ, xyz)
    rgb = torch.where(linear > 0.0031308, 1.055 * linear.clamp(min=0.0) ** (1 / 2.4) - 0.055, 12.92 * linear)
    return rgb.clamp(0.0, 1.0)


@dataclass(frozen=True)
class ColourReference:
    """Per-channel LAB mean and standard deviation of a reference image: ``(B, 3, 1, 1, 1)`` float32 each."""

    mean: Tensor
    std: Tensor


def _lab_stats(frames: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    lab = srgb_to_lab((frames.float() + 1) / 2)
    mean = lab.mean(dim=(3, 4), keepdim=True)
    std = lab.std(dim=(3, 4), keepdim=True, correction=0)
    return lab, mean, std


def colour_reference(image: Tensor) -> ColourReference:
    """The statistics to match, from the reference image ``(B, 3, 1, H, W)`` in [-1, 1]."""
    if image.ndim != 5 or image.shape[1] != 3 or image.shape[2] != 1:
        raise ValueError(f"reference image must be (B, 3, 1, H, W), got {tuple(image.shape)}")
    _, mean, std = _lab_stats(image)
    return ColourReference(mean, std)


def match_colours(frames: Tensor, reference: ColourReference, strength: float = 1.0) -> Tensor:
    """Frames ``(B, 3, T, H, W)`` in [-1, 1] with each frame's LAB statistics moved to the reference's, blended by
    ``strength`` in [0, 1]; same shape and dtype. A flat channel (std 0) is shifted, not scaled."""
    if not 0.0 <= strength <= 1.0:
        raise ValueError(f"strength must be in [0, 1], got {strength}")
    if frames.ndim != 5 or frames.shape[1] != 3 or reference.mean.shape[0] != frames.shape[0]:
        raise ValueError(f"frames must be (B, 3, T, H, W) with the reference's B, got {tuple(frames.shape)}")
    lab, mean, std = _lab_stats(frames)
    gain = reference.std / torch.where(std < 1e-8, torch.ones_like(std), std)
    corrected = lab_to_srgb((lab - mean) * gain + reference.mean)
    source = (frames.float() + 1) / 2
    blended = torch.lerp(source, corrected, strength)
    return (blended * 2 - 1).to(frames.dtype)
