"""The LTX-Video VAE (FlashHead Lite) against diffusers' AutoencoderKLLTXVideo, from a diffusers-style folder.

Seeded random weights at the real channel widths, written as ``VAE_LTX/`` (``config.json`` +
``diffusion_pytorch_model.safetensors``, names and shapes taken from diffusers' model); diffusers loads the same
folder with ``from_pretrained``. Tiny frames (32x32 -> 1x1 latents), few frames.
"""

from __future__ import annotations

import json
import math
import struct

import pytest
import torch
from diffusers import AutoencoderKLLTXVideo
from safetensors.torch import save_file

from charstream.model.families.flashhead.errors import CheckpointError
from charstream.model.families.flashhead.vae_ltx import LTX_VAE_CONFIG, load_ltx_vae


def random_ltx_state(seed: int) -> dict[str, torch.Tensor]:
    """Fan-in scaled weights for every tensor of diffusers' LTX-Video 0.9.0 VAE, slices of one seeded pool (fast)."""
    config = {k: v for k, v in LTX_VAE_CONFIG.items() if not k.startswith("_")}
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in AutoencoderKLLTXVideo(**config).state_dict().items()}
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(1 << 22, generator=g)
    state = {}
    for name, shape in shapes.items():
        n = math.prod(shape)
        start = int(torch.randint(0, pool.numel() - min(n, pool.numel()) + 1, (1,), generator=g))
        t = pool[start:start + n].repeat(math.ceil(n / pool.numel()))[:n].reshape(shape)
        if name == "latents_std":
            t = 0.5 + t.abs()
        elif name.endswith("bias") or name == "latents_mean":
            t = 0.1 * t
        elif name.endswith("norm3.weight"):
            t = 1.0 + 0.2 * t
        else:
            t = t / math.sqrt(math.prod(shape[1:]))
        state[name] = t.to(torch.bfloat16)  # half the bytes to write; both sides read the same values
    return state


def write_sparse_safetensors(path, shapes: dict[str, tuple[int, ...]]) -> None:
    """A float32 safetensors file of the given shapes whose data is a hole (zeros): instant, whatever its size."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        n = 4 * math.prod(shape)
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(blob)) + blob)
        f.truncate(8 + len(blob) + offset)


@pytest.fixture(scope="module")
def ltx_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("VAE_LTX")
    (folder / "config.json").write_text(json.dumps(LTX_VAE_CONFIG | {"_diffusers_version": "0.32.0.dev0"}))
    save_file(random_ltx_state(0), folder / "diffusion_pytorch_model.safetensors")
    return folder


@pytest.fixture(scope="module")
def ours(ltx_folder):
    return load_ltx_vae(ltx_folder)


@pytest.fixture(scope="module")
def oracle(ltx_folder):
    vae = AutoencoderKLLTXVideo.from_pretrained(ltx_folder, torch_dtype=torch.float32).eval()
    assert vae.decoder.conv_in.conv.weight.dtype == torch.float32
    return vae


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def stats(vae: AutoencoderKLLTXVideo) -> tuple[torch.Tensor, torch.Tensor]:
    return vae.latents_mean.view(1, -1, 1, 1, 1), vae.latents_std.view(1, -1, 1, 1, 1)


@torch.no_grad()
def test_decode_matches_diffusers(ours, oracle):
    latents = torch.randn(1, 128, 2, 1, 1, generator=torch.Generator().manual_seed(1))
    mean, std = stats(oracle)
    frames = ours.decode_chunk(latents)
    expected = oracle.decode(latents * std + mean).sample
    assert frames.shape == expected.shape == (1, 3, 9, 32, 32)
    assert frames.std() > 0.05
    assert rel(frames, expected) < 1e-4


@torch.no_grad()
def test_encode_matches_diffusers(ours, oracle):
    frames = torch.rand(1, 3, 9, 32, 32, generator=torch.Generator().manual_seed(2)) * 2 - 1
    mean, std = stats(oracle)
    posterior = oracle.encode(frames).latent_dist
    latents = ours.encode_motion(frames)
    assert latents.shape == (1, 128, 2, 1, 1)
    assert rel(latents, (posterior.mode() - mean) / std) < 1e-4
    # Sampling: the same noise through both gives the same latents.
    noise = torch.randn(posterior.mean.shape, generator=torch.Generator().manual_seed(3))
    assert ours.latent_shape(frames.shape) == tuple(noise.shape)
    sampled = ours.encode_motion(frames, noise)
    assert rel(sampled, (posterior.mean + posterior.std * noise - mean) / std) < 1e-4
    assert rel(sampled, latents) > 1e-3


def test_refuses_bad_folders(ltx_folder, ours, tmp_path):
    weights = ltx_folder / "diffusion_pytorch_model.safetensors"
    with pytest.raises(CheckpointError, match="config.json: file not found"):
        load_ltx_vae(tmp_path)

    (tmp_path / "config.json").write_text(json.dumps(LTX_VAE_CONFIG | {"patch_size": 2}))
    with pytest.raises(CheckpointError, match="patch_size is 2, expected 4"):
        load_ltx_vae(tmp_path)

    (tmp_path / "config.json").write_text(json.dumps(LTX_VAE_CONFIG))
    with weights.open("rb") as f:
        (tmp_path / "diffusion_pytorch_model.safetensors").write_bytes(f.read(1 << 20))
    with pytest.raises(CheckpointError, match="diffusion_pytorch_model.safetensors: truncated"):
        load_ltx_vae(tmp_path)

    shapes = {k: tuple(v.shape) for k, v in ours.state_dict().items() if k != "decoder.conv_out.conv.bias"}
    shapes["encoder.conv_in.conv.weight"] = (128, 48, 1, 3, 3)
    write_sparse_safetensors(tmp_path / "diffusion_pytorch_model.safetensors", shapes)
    with pytest.raises(CheckpointError, match=r"1 missing tensor\(s\), e.g. decoder.conv_out.conv.bias; "
                                              r"1 tensor\(s\) of the wrong shape, e.g. encoder.conv_in.conv.weight"):
        load_ltx_vae(tmp_path)

    with pytest.raises(ValueError, match="1 \\+ 8k"):
        ours.encode_motion(torch.zeros(1, 3, 5, 32, 32))
