"""FlashHead's LAB colour match against a float64 NumPy implementation of the standard sRGB <-> CIELAB (D65)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from charstream.model.families.flashhead.colour import (
    colour_reference,
    lab_to_srgb,
    match_colours,
    srgb_to_lab,
)

M = np.array([[0.4124564, 0.3575761, 0.1804375], [0.2126729, 0.7151522, 0.0721750], [0.0193339, 0.1191920, 0.9503041]])
WHITE = np.array([0.95047, 1.0, 1.08883])
EPS, KAPPA = 216 / 24389, 24389 / 27


def ref_lab(rgb: np.ndarray) -> np.ndarray:
    """sRGB (..., 3) in [0, 1] -> LAB (..., 3), float64, by the textbook formulas."""
    linear = np.where(rgb <= 0.04045, rgb / 12.92, ((rgb + 0.055) / 1.055) ** 2.4)
    t = np.einsum("ij,...j->...i", M, linear) / WHITE
    f = np.where(t > EPS, np.cbrt(t), (KAPPA * t + 16) / 116)
    return np.stack([116 * f[..., 1] - 16, 500 * (f[..., 0] - f[..., 1]), 200 * (f[..., 1] - f[..., 2])], -1)


def ref_srgb(lab: np.ndarray) -> np.ndarray:
    fy = (lab[..., 0] + 16) / 116
    fx, fz = fy + lab[..., 1] / 500, fy - lab[..., 2] / 200
    x = np.where(fx**3 > EPS, fx**3, (116 * fx - 16) / KAPPA)
    y = np.where(lab[..., 0] > KAPPA * EPS, fy**3, lab[..., 0] / KAPPA)
    z = np.where(fz**3 > EPS, fz**3, (116 * fz - 16) / KAPPA)
    linear = np.einsum("ij,...j->...i", np.linalg.inv(M), np.stack([x, y, z], -1) * WHITE)
    rgb = np.where(linear <= 0.0031308, 12.92 * linear, 1.055 * np.maximum(linear, 0) ** (1 / 2.4) - 0.055)
    return np.clip(rgb, 0, 1)


def ref_match(frames: np.ndarray, image: np.ndarray, strength: float) -> np.ndarray:
    """frames (T, H, W, 3), image (H, W, 3), both in [-1, 1]."""
    src = (frames + 1) / 2
    lab, target = ref_lab(src), ref_lab((image + 1) / 2)
    mean, std = lab.mean(axis=(1, 2), keepdims=True), lab.std(axis=(1, 2), keepdims=True)
    out = ref_srgb((lab - mean) / std * target.std(axis=(0, 1)) + target.mean(axis=(0, 1)))
    return ((1 - strength) * src + strength * out) * 2 - 1


def to_video(frames: np.ndarray) -> torch.Tensor:
    """(B, T, H, W, 3) NumPy -> (B, 3, T, H, W) float32 tensor."""
    return torch.from_numpy(frames).float().permute(0, 4, 1, 2, 3)


def test_known_colours():
    rgb = torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.5, 0.5, 0.5]]).view(4, 3, 1)
    lab = srgb_to_lab(rgb).view(4, 3)
    expected = torch.tensor([[100.0, 0.0, 0.0], [0.0, 0.0, 0.0], [53.2408, 80.0925, 67.2032], [53.3889, 0.0, 0.0]])
    assert torch.allclose(lab, expected, atol=2e-3)
    assert torch.allclose(lab_to_srgb(lab.view(4, 3, 1)), rgb, atol=1e-5)


def test_conversions_match_float64():
    rgb = np.random.default_rng(0).random((2000, 3))
    lab = srgb_to_lab(torch.from_numpy(rgb).float().T.unsqueeze(0)).squeeze(0).T.double().numpy()
    assert np.abs(lab - ref_lab(rgb)).max() < 1e-3  # L spans 0..100: float32 rounding
    back = lab_to_srgb(torch.from_numpy(ref_lab(rgb)).float().T.unsqueeze(0)).squeeze(0).T.double().numpy()
    assert np.abs(back - rgb).max() < 1e-5


@pytest.mark.parametrize("strength", [1.0, 0.4])
def test_match_matches_float64(strength):
    rng = np.random.default_rng(1)
    # Frames with a colour cast and low contrast against a neutral, contrasty reference: a real correction.
    frames = np.clip(rng.normal(0.0, 0.25, (2, 6, 12, 16, 3)) + np.array([0.3, -0.1, -0.2]), -1, 1)
    image = rng.uniform(-1, 1, (2, 12, 16, 3))
    reference = colour_reference(to_video(image[:, None]))
    ours = match_colours(to_video(frames), reference, strength)
    expected = np.stack([ref_match(frames[b], image[b], strength) for b in range(2)])
    expected = to_video(expected).double()
    assert ours.shape == (2, 3, 6, 12, 16) and ours.dtype == torch.float32
    assert (ours.double() - expected).abs().max() < 1e-4
    assert (to_video(frames).double() - expected).abs().max() > 0.2  # the correction is not a no-op


def test_reference_matched_to_itself_is_unchanged_and_bf16_keeps_dtype():
    image = torch.rand(1, 3, 1, 16, 16, generator=torch.Generator().manual_seed(2)) * 2 - 1
    assert (match_colours(image, colour_reference(image)) - image).abs().max() < 1e-4
    out = match_colours(image.repeat(1, 1, 3, 1, 1).bfloat16(), colour_reference(image))
    assert out.dtype == torch.bfloat16 and (out.float() - image).abs().max() < 2e-2


def test_refusals():
    image = torch.zeros(1, 3, 1, 8, 8)
    with pytest.raises(ValueError, match="strength"):
        match_colours(image, colour_reference(image), 1.5)
    with pytest.raises(ValueError, match=r"\(B, 3, 1, H, W\)"):
        colour_reference(torch.zeros(1, 3, 2, 8, 8))
