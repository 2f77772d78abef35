"""The Wan2.1 VAE (FlashHead Pro) against diffusers' AutoencoderKLWan, from a file in the original key space.

Seeded random weights at the real channel widths, written as the original ``Wan2.1_VAE.pth`` (a flat torch zip
state dict, names from the Wan2.1 architecture listed here independently of our key map); diffusers loads the same
file through its own converter. Tiny frames (16x16 -> 2x2 latents), few frames.
"""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import AutoencoderKLWan
from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers

from charstream.model.families.flashhead.errors import CheckpointError
from charstream.model.families.flashhead.vae_wan import LATENT_MEAN, LATENT_STD, load_wan_vae


def _residual(prefix: str, cin: int, cout: int) -> dict[str, tuple[int, ...]]:
    shapes = {f"{prefix}.residual.0.gamma": (cin, 1, 1, 1), f"{prefix}.residual.2.weight": (cout, cin, 3, 3, 3),
              f"{prefix}.residual.2.bias": (cout,), f"{prefix}.residual.3.gamma": (cout, 1, 1, 1),
              f"{prefix}.residual.6.weight": (cout, cout, 3, 3, 3), f"{prefix}.residual.6.bias": (cout,)}
    if cin != cout:
        shapes |= {f"{prefix}.shortcut.weight": (cout, cin, 1, 1, 1), f"{prefix}.shortcut.bias": (cout,)}
    return shapes


def _middle(prefix: str, c: int) -> dict[str, tuple[int, ...]]:
    return (_residual(f"{prefix}.middle.0", c, c) | _residual(f"{prefix}.middle.2", c, c)
            | {f"{prefix}.middle.1.norm.gamma": (c, 1, 1), f"{prefix}.middle.1.to_qkv.weight": (3 * c, c, 1, 1),
               f"{prefix}.middle.1.to_qkv.bias": (3 * c,), f"{prefix}.middle.1.proj.weight": (c, c, 1, 1),
               f"{prefix}.middle.1.proj.bias": (c,)})


def wan21_vae_shapes() -> dict[str, tuple[int, ...]]:
    """Every tensor of the original Wan2.1 VAE checkpoint (dim 96, mults 1 2 4 4, 2 res blocks, z 16)."""
    s: dict[str, tuple[int, ...]] = {"encoder.conv1.weight": (96, 3, 3, 3, 3), "encoder.conv1.bias": (96,)}
    # encoder: [res, res, down2d] [res, res, down3d] [res, res, down3d] [res, res]
    layout = [(96, 96, "2d"), (96, 192, "3d"), (192, 384, "3d"), (384, 384, None)]
    i = 0
    for cin, cout, down in layout:
        for _ in range(2):
            s |= _residual(f"encoder.downsamples.{i}", cin, cout)
            cin, i = cout, i + 1
        if down:
            s |= {f"encoder.downsamples.{i}.resample.1.weight": (cout, cout, 3, 3),
                  f"encoder.downsamples.{i}.resample.1.bias": (cout,)}
            if down == "3d":
                s |= {f"encoder.downsamples.{i}.time_conv.weight": (cout, cout, 3, 1, 1),
                      f"encoder.downsamples.{i}.time_conv.bias": (cout,)}
            i += 1
    s |= _middle("encoder", 384) | {"encoder.head.0.gamma": (384, 1, 1, 1), "encoder.head.2.weight": (32, 384, 3, 3, 3),
                                    "encoder.head.2.bias": (32,)}
    s |= {"conv1.weight": (32, 32, 1, 1, 1), "conv1.bias": (32,), "conv2.weight": (16, 16, 1, 1, 1), "conv2.bias": (16,)}
    s |= {"decoder.conv1.weight": (384, 16, 3, 3, 3), "decoder.conv1.bias": (384,)} | _middle("decoder", 384)
    # decoder: [3 res, up3d] [3 res, up3d] [3 res, up2d] [3 res]
    layout = [(384, 384, "3d"), (192, 384, "3d"), (192, 192, "2d"), (96, 96, None)]
    i = 0
    for cin, cout, up in layout:
        for _ in range(3):
            s |= _residual(f"decoder.upsamples.{i}", cin, cout)
            cin, i = cout, i + 1
        if up:
            s |= {f"decoder.upsamples.{i}.resample.1.weight": (cout // 2, cout, 3, 3),
                  f"decoder.upsamples.{i}.resample.1.bias": (cout // 2,)}
            if up == "3d":
                s |= {f"decoder.upsamples.{i}.time_conv.weight": (2 * cout, cout, 3, 1, 1),
                      f"decoder.upsamples.{i}.time_conv.bias": (2 * cout,)}
            i += 1
    s |= {"decoder.head.0.gamma": (96, 1, 1, 1), "decoder.head.2.weight": (3, 96, 3, 3, 3), "decoder.head.2.bias": (3,)}
    return s


def random_wan_state(seed: int) -> dict[str, torch.Tensor]:
    """Weights that keep activations O(1) through the whole net: fan-in scaled convs, gains near 1."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, shape in wan21_vae_shapes().items():
        if name.endswith("gamma"):
            t = 1.0 + 0.2 * torch.randn(shape, generator=g)
        elif name.endswith("bias"):
            t = 0.1 * torch.randn(shape, generator=g)
        else:
            t = torch.randn(shape, generator=g) / math.sqrt(math.prod(shape[1:]))
        state[name] = t
    return state


@pytest.fixture(scope="module")
def wan_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("VAE_Wan") / "Wan2.1_VAE.pth"
    state = random_wan_state(0)
    torch.save(state, path)
    return path, state


@pytest.fixture(scope="module")
def oracle(wan_file):
    _, state = wan_file
    with torch.device("meta"):
        vae = AutoencoderKLWan()  # diffusers' defaults are Wan2.1's VAE
    vae.load_state_dict(convert_wan_vae_to_diffusers(state), strict=True, assign=True)
    return vae.eval()


@pytest.fixture(scope="module")
def ours(wan_file):
    return load_wan_vae(wan_file[0])


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@torch.no_grad()
def test_decode_matches_diffusers(ours, oracle):
    latents = torch.randn(1, 16, 3, 2, 2, generator=torch.Generator().manual_seed(1))
    frames = ours.decode_chunk(latents)
    raw = latents * torch.tensor(LATENT_STD).view(1, 16, 1, 1, 1) + torch.tensor(LATENT_MEAN).view(1, 16, 1, 1, 1)
    expected = oracle.decode(raw).sample
    assert frames.shape == expected.shape == (1, 3, 9, 16, 16)
    assert frames.abs().max() <= 1.0 and frames.std() > 0.05  # clamped, and not collapsed
    assert rel(frames, expected) < 1e-4


@torch.no_grad()
def test_a_clip_decoded_in_parts_is_the_clip_decoded_at_once(ours):
    """Each causal conv's last input frames carried from one part to the next: cut anywhere after the second
    latent, in two parts or three, the frames are the whole decode's; a first part of one latent is refused."""
    latents = torch.randn(2, 16, 9, 2, 2, generator=torch.Generator().manual_seed(5))
    whole = ours.decode_chunk(latents)
    for cuts in ((2,), (4,), (8,), (3, 4)):
        parts, history = [], None
        for start, end in zip((0, *cuts), (*cuts, 9), strict=True):
            frames, history = ours.decode_part(latents[:, :, start:end], history, last=end == 9)
            parts.append(frames)
        assert [p.shape[2] for p in parts][0] == 1 + 4 * (cuts[0] - 1) and history == ()
        # fp32 rounding only (alone the parts are the whole bit for bit; after other convolutions in the
        # process oneDNN may pick another algorithm for a part's shape): a wrong history is ~1e-1 off
        assert rel(torch.cat(parts, dim=2), whole) < 1e-5, cuts
    with pytest.raises(ValueError, match="at least 2 latents"):
        ours.decode_part(latents[:, :, :1])


@torch.no_grad()
def test_encode_matches_diffusers(ours, oracle):
    frames = torch.rand(1, 3, 5, 16, 16, generator=torch.Generator().manual_seed(2)) * 2 - 1
    latents = ours.encode_motion(frames)
    mu = oracle.encode(frames).latent_dist.mode()
    expected = (mu - torch.tensor(LATENT_MEAN).view(1, 16, 1, 1, 1)) / torch.tensor(LATENT_STD).view(1, 16, 1, 1, 1)
    assert latents.shape == expected.shape == (1, 16, 2, 2, 2)
    assert rel(latents, expected) < 1e-4


@torch.no_grad()
def test_single_latent_and_single_frame(ours, oracle):
    """The first-frame special case alone: one latent -> one frame, one frame -> one latent."""
    latents = torch.randn(1, 16, 1, 2, 2, generator=torch.Generator().manual_seed(3))
    raw = latents * torch.tensor(LATENT_STD).view(1, 16, 1, 1, 1) + torch.tensor(LATENT_MEAN).view(1, 16, 1, 1, 1)
    assert rel(ours.decode_chunk(latents), oracle.decode(raw).sample) < 1e-4
    image = torch.rand(1, 3, 1, 16, 16, generator=torch.Generator().manual_seed(4)) * 2 - 1
    assert ours.encode_motion(image).shape == (1, 16, 1, 2, 2)


def test_refuses_bad_files(wan_file, ours, tmp_path):
    """Shapes are checked from the file's index before any tensor is read: stride-0 stand-ins keep the files small."""
    path, _ = wan_file
    state = {name: torch.zeros(1).expand(shape) for name, shape in wan21_vae_shapes().items()}
    with pytest.raises(CheckpointError, match="file not found"):
        load_wan_vae(tmp_path / "absent.pth")

    whole, truncated = tmp_path / "whole.pth", tmp_path / "truncated.pth"
    torch.save(state, whole)
    truncated.write_bytes(whole.read_bytes()[: whole.stat().st_size - 100])
    with pytest.raises(CheckpointError, match="truncated.pth: not a complete torch checkpoint"):
        load_wan_vae(truncated)

    missing = tmp_path / "missing.pth"
    torch.save({k: v for k, v in state.items() if k != "decoder.head.2.bias"}, missing)
    with pytest.raises(CheckpointError, match=r"1 missing tensor\(s\), e.g. decoder.head_conv.bias"):
        load_wan_vae(missing)

    wrong = tmp_path / "wrong.pth"
    torch.save(state | {"conv2.weight": torch.zeros(16, 16, 3, 3, 3)}, wrong)
    with pytest.raises(CheckpointError, match=r"post_quant_conv.weight is \(16, 16, 3, 3, 3\), expected"):
        load_wan_vae(wrong)

    with pytest.raises(ValueError, match="1 \\+ 4k"):
        ours.encode_motion(torch.zeros(1, 3, 4, 16, 16))


def test_a_narrower_vae_keeps_the_latents_and_is_refused_where_weights_are_released(tmp_path):
    """``vae_width`` (a CPU check's VAE): the same latents and frames at a fraction of the channels, random
    weights only; a width that leaves no even channel count, or a released folder, is refused naming it."""
    from charstream.model.families.flashhead.family import FlashHeadFamily
    from charstream.model.families.flashhead.vae_ltx import random_ltx_vae
    from charstream.model.families.flashhead.vae_wan import random_wan_vae
    from charstream.pipeline.arguments import sized_family

    narrow = random_wan_vae(0, width=0.25)
    assert narrow.decoder.conv_in.out_channels == 96  # 24 base channels x 4 at the deepest level
    with torch.no_grad():
        frames = narrow.decode_chunk(torch.randn(1, 16, 3, 2, 2))
        assert frames.shape == (1, 3, 9, 16, 16) and narrow.encode_motion(frames).shape == (1, 16, 3, 2, 2)
    assert random_ltx_vae(0, width=0.25).decoder.conv_in.conv.out_channels == 128  # 512 / 4
    with pytest.raises(ValueError, match="even number"):
        random_wan_vae(0, width=0.01)
    family = sized_family("flashhead-pro", 1, 32, 0.25)
    assert family.config.vae_width == 0.25 and family.config.n_blocks == 1
    with pytest.raises(ValueError, match=r"fraction in \(0, 1\]"):
        sized_family("flashhead-pro", vae_width=2.0)
    with pytest.raises(ValueError, match="random weights only"):
        FlashHeadFamily("pro", config=family.config).generator(str(tmp_path))
