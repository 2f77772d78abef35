"""Causal video VAE: streaming decode == whole-clip decode, causality, shapes, weights, training."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

from charstream.model.config import CHARACTERS_57B, TINY
from charstream.model.vae import Decoder, VideoVAE, to_uint8_frames

pytestmark = pytest.mark.usefixtures("one_torch_thread")


SMALL = TINY.with_(height=32, width=32)  # same architecture as tiny, 16x fewer pixels: fast CPU tests


def _random_vae(cfg, seed: int = 0) -> VideoVAE:
    """Fresh weights plus a perturbation of the norm gains, so every path carries signal."""
    torch.manual_seed(seed)
    vae = VideoVAE(cfg).eval()
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if name.endswith("norm1.weight") or name.endswith("norm2.weight"):
                p.add_(0.3 * torch.randn_like(p))
    return vae


def test_streaming_decode_equals_whole_clip_decode() -> None:
    vae = _random_vae(TINY)
    latents = torch.randn(1, 4, TINY.latent_channels, TINY.latent_height, TINY.latent_width)
    with torch.inference_mode():
        whole, whole_state = vae.decode(latents)
        state, pieces = None, []
        for t in range(latents.shape[1]):
            video, state = vae.decode(latents[:, t : t + 1], state)
            pieces.append(video)
    streamed = torch.cat(pieces, dim=1)
    assert whole.shape == (1, 16, 3, TINY.height, TINY.width)
    rel = ((streamed - whole).norm() / whole.norm()).item()
    assert rel < 1e-5, rel
    assert state.frames == whole_state.frames == 4
    for a, b in zip(state.caches, whole_state.caches, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_decoder_is_causal_and_uses_history() -> None:
    vae = _random_vae(SMALL, seed=1)
    latents = torch.randn(1, 4, SMALL.latent_channels, SMALL.latent_height, SMALL.latent_width)
    changed = latents.clone()
    changed[:, 2] += 1.0
    with torch.inference_mode():
        a, _ = vae.decode(latents)
        b, _ = vae.decode(changed)
    k = SMALL.frames_per_chunk
    torch.testing.assert_close(a[:, : 2 * k], b[:, : 2 * k])  # the past does not see the future
    assert (a[:, 3 * k :] - b[:, 3 * k :]).abs().max() > 1e-4  # later frames do see the change


def test_encoder_is_causal() -> None:
    vae = _random_vae(SMALL, seed=2)
    video = torch.rand(1, 12, 3, SMALL.height, SMALL.width) * 2 - 1
    changed = video.clone()
    changed[:, 8:] = 0.0  # the third latent frame's input only
    with torch.inference_mode():
        a, b = vae.encode(video), vae.encode(changed)
    torch.testing.assert_close(a[:, :2], b[:, :2])
    assert (a[:, 2] - b[:, 2]).abs().max() > 1e-4


def test_shapes_tiny_and_full_size_on_meta() -> None:
    vae = _random_vae(TINY)
    with torch.inference_mode():
        video = torch.rand(1, 8, 3, TINY.height, TINY.width) * 2 - 1
        latents = vae.encode(video)
        assert latents.shape == (1, 2, TINY.latent_channels, 16, 16)
        assert vae.encode_image(video[:, 0]).shape == (1, TINY.latent_channels, 16, 16)
        frames, state = vae.decoder.decode_chunk(latents[0, 0])
        assert frames.shape == (TINY.frames_per_chunk, 3, TINY.height, TINY.width)
        assert to_uint8_frames(frames).shape == (TINY.frames_per_chunk, TINY.height, TINY.width, 3)
    big = CHARACTERS_57B
    with torch.device("meta"):
        vae57 = VideoVAE(big)
        lat = torch.empty(1, 2, big.latent_channels, big.latent_height, big.latent_width)
        out, state = vae57.decode(lat)
        assert out.shape == (1, 8, 3, big.height, big.width)
        assert state.frames == 2 and all(c.device.type == "meta" for c in state.caches)
        mean, logvar = vae57.encoder(torch.empty(1, 4, 3, big.height, big.width))
        assert mean.shape == logvar.shape == (1, 1, big.latent_channels, 44, 68)


def test_bad_configs_and_inputs_fail_clearly() -> None:
    with pytest.raises(ValueError, match="vae_spatial=16 needs log2"):
        Decoder(TINY.with_(vae_spatial=16))
    with pytest.raises(ValueError, match="not divisible by 8"):
        VideoVAE(TINY.with_(height=100))
    vae = _random_vae(SMALL)
    with pytest.raises(ValueError, match="8 latent channels, got 4"):
        vae.decode(torch.zeros(1, 1, 4, 4, 4))
    with pytest.raises(ValueError, match="encoder expects"):
        vae.encode(torch.zeros(1, 5, 3, 32, 32))


def test_uint8_conversion() -> None:
    frames = torch.tensor([-2.0, -1.0, 0.0, 1.0, 3.0]).view(1, 5, 1, 1).expand(1, 5, 3, 2).transpose(1, 2)
    out = to_uint8_frames(frames.reshape(1, 3, 5, 2))
    assert out.dtype == torch.uint8 and out.shape == (1, 5, 2, 3)
    assert out[0, :, 0, 0].tolist() == [0, 0, 128, 255, 255]


def test_weights_round_trip_through_safetensors(tmp_path) -> None:
    vae = _random_vae(SMALL, seed=3)
    vae.set_latent_stats(torch.linspace(-1, 1, SMALL.latent_channels), torch.full((SMALL.latent_channels,), 2.0))
    path = tmp_path / "vae.safetensors"
    save_file(vae.state_dict(), str(path))
    loaded = VideoVAE(SMALL).eval()
    loaded.load_state_dict(load_file(str(path)), strict=True)
    latents = torch.randn(1, 2, SMALL.latent_channels, 4, 4)
    with torch.inference_mode():
        torch.testing.assert_close(loaded.decode(latents)[0], vae.decode(latents)[0])
    # a decoder-only process loads just the decoder's weights
    decoder = Decoder(SMALL)
    decoder.load_state_dict({k.removeprefix("decoder."): v for k, v in load_file(str(path)).items()
                             if k.startswith("decoder.")}, strict=True)
    torch.testing.assert_close(decoder.latent_std, torch.full((SMALL.latent_channels,), 2.0))


def test_bf16_decode_matches_fp32() -> None:
    vae = _random_vae(SMALL, seed=4)
    latents = torch.randn(1, 2, SMALL.latent_channels, 4, 4)
    with torch.inference_mode():
        ref, _ = vae.decode(latents)
        low, state = vae.to(torch.bfloat16).decode(latents.bfloat16())
    assert low.dtype == torch.bfloat16 and state.caches[0].dtype == torch.bfloat16
    assert ((low.float() - ref).norm() / ref.norm()).item() < 0.05


def test_vae_trains() -> None:
    """A few optimiser steps on one clip cut the KL-regularised reconstruction loss."""
    torch.manual_seed(5)
    vae = VideoVAE(SMALL)
    t = torch.linspace(0, 1, 4)[:, None, None, None]
    yy, xx = torch.meshgrid(torch.linspace(-1, 1, 32), torch.linspace(-1, 1, 32), indexing="ij")
    video = torch.stack([torch.sin(3 * xx + 2 * t), torch.cos(2 * yy - t), xx * yy * t], dim=1)[None, :, :, 0]
    video = video.reshape(1, 4, 3, 32, 32)
    opt = torch.optim.Adam(vae.parameters(), lr=3e-3)
    losses = []
    for _ in range(20):
        out = vae.loss(video)
        opt.zero_grad()
        out["loss"].backward()
        opt.step()
        losses.append(out["recon"].item())
    assert losses[-1] < 0.5 * losses[0], (losses[0], losses[-1])
