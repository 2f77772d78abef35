"""The LTX-Video (0.9.0) video VAE of SoulX-FlashHead Lite: 128 latent channels, x8 in time, x32 in space.

Layouts and contracts:
- frames: ``(B, 3, F, H, W)`` float in [-1, 1], ``F = 1 + 8 * k``;
- latents: ``(B, 128, 1 + k, H / 32, W / 32)``, normalised per channel with the statistics stored in the weights
  (``(z - latents_mean) / latents_std``), the DiT's space.

The net: 4x4 pixel patches (48 channels) at the input and output, residual blocks of RMS norm (no gain) + SiLU +
3-D conv, and x2 resampling in time, height and width at once (a stride-2 conv down; a conv to 8x the channels,
then depth-to-space up, dropping the first frame). The encoder is causal, its time padding the first frame
repeated; the decoder is not, padding with the first and last frames. Both run over the whole clip (FlashHead
encodes and decodes each chunk on its own). The encoder's posterior has one log-variance for all channels; Lite
samples from it when it re-encodes the motion frames (``encode_motion(..., noise=)``).

Weights load from the diffusers-style ``VAE_LTX/`` folder (``config.json`` +
``diffusion_pytorch_model.safetensors``); module names are diffusers', so no key map is needed.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import Tensor, nn

from charstream.model.families.flashhead.errors import CheckpointError
from charstream.model.families.flashhead.vae_files import check_shapes, safetensors_shapes

LATENT_CHANNELS = 128
PATCH = 4
TEMPORAL_STRIDE = 8
SPATIAL_STRIDE = 32
# The one VAE config SoulX-FlashHead Lite accepts (LTX-Video 0.9.0 in diffusers' form); anything else is refused.
LTX_VAE_CONFIG = {
    "_class_name": "AutoencoderKLLTXVideo",
    "block_out_channels": [128, 256, 512, 512],
    "decoder_causal": False,
    "encoder_causal": True,
    "in_channels": 3,
    "latent_channels": 128,
    "layers_per_block": [4, 3, 3, 3, 4],
    "out_channels": 3,
    "patch_size": 4,
    "patch_size_t": 1,
    "resnet_norm_eps": 1e-06,
    "scaling_factor": 1.0,
    "spatio_temporal_scaling": [True, True, True, False],
}
_OPTIONAL_DEFAULTS = {"timestep_conditioning": False}  # a key a later diffusers writes; must keep its default


def _rms(x: Tensor) -> Tensor:
    """Unit RMS over channels (dim 1), no gain."""
    return x * torch.rsqrt(x.float().pow(2).mean(dim=1, keepdim=True) + 1e-8).to(x.dtype)


class CausalConv3d(nn.Module):
    """Kernel-3 (or 1) 3-D conv padded in time by repeating edge frames: the first frame k-1 times in front when
    causal; else the first and last frames (k-1)/2 times each. Zero padding in space."""

    def __init__(self, in_dim: int, out_dim: int, kernel: int = 3, stride: int = 1, causal: bool = True) -> None:
        super().__init__()
        self.conv = nn.Conv3d(in_dim, out_dim, kernel, stride=stride, padding=(0, kernel // 2, kernel // 2))
        self.front, self.back = (kernel - 1, 0) if causal else ((kernel - 1) // 2, (kernel - 1) // 2)

    def forward(self, x: Tensor) -> Tensor:
        if self.front or self.back:
            x = torch.cat([x[:, :, :1].expand(-1, -1, self.front, -1, -1), x,
                           x[:, :, -1:].expand(-1, -1, self.back, -1, -1)], dim=2)
        return self.conv(x)


class ResnetBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, causal: bool) -> None:
        super().__init__()
        self.conv1 = CausalConv3d(in_dim, out_dim, causal=causal)
        self.conv2 = CausalConv3d(out_dim, out_dim, causal=causal)
        if in_dim != out_dim:
            self.norm3 = nn.LayerNorm(in_dim, eps=1e-6)
            self.conv_shortcut = CausalConv3d(in_dim, out_dim, kernel=1, causal=causal)
        else:
            self.norm3 = self.conv_shortcut = None

    def forward(self, x: Tensor) -> Tensor:
        h = self.conv1(F.silu(_rms(x)))
        h = self.conv2(F.silu(_rms(h)))
        if self.conv_shortcut is not None:
            x = self.conv_shortcut(self.norm3(x.movedim(1, -1)).movedim(-1, 1))
        return h + x


class Upsampler(nn.Module):
    """x2 in time, height and width: a conv to 8x the channels, depth-to-space, minus the first frame."""

    def __init__(self, dim: int, causal: bool) -> None:
        super().__init__()
        self.conv = CausalConv3d(dim, dim * 8, causal=causal)

    def forward(self, x: Tensor) -> Tensor:
        b, _, t, h, w = x.shape
        y = self.conv(x).reshape(b, -1, 2, 2, 2, t, h, w).permute(0, 1, 5, 2, 6, 3, 7, 4)
        return y.reshape(b, -1, 2 * t, 2 * h, 2 * w)[:, :, 1:]


class DownBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, layers: int, downsample: bool) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(ResnetBlock(in_dim, in_dim, causal=True) for _ in range(layers))
        self.downsamplers = nn.ModuleList([CausalConv3d(in_dim, in_dim, stride=2)]) if downsample else None
        self.conv_out = ResnetBlock(in_dim, out_dim, causal=True) if in_dim != out_dim else None

    def forward(self, x: Tensor) -> Tensor:
        for resnet in self.resnets:
            x = resnet(x)
        if self.downsamplers is not None:
            x = self.downsamplers[0](x)
        return x if self.conv_out is None else self.conv_out(x)


class UpBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int, layers: int, upsample: bool) -> None:
        super().__init__()
        self.conv_in = ResnetBlock(in_dim, out_dim, causal=False) if in_dim != out_dim else None
        self.upsamplers = nn.ModuleList([Upsampler(out_dim, causal=False)]) if upsample else None
        self.resnets = nn.ModuleList(ResnetBlock(out_dim, out_dim, causal=False) for _ in range(layers))

    def forward(self, x: Tensor) -> Tensor:
        if self.conv_in is not None:
            x = self.conv_in(x)
        if self.upsamplers is not None:
            x = self.upsamplers[0](x)
        for resnet in self.resnets:
            x = resnet(x)
        return x


class MidBlock(nn.Module):
    def __init__(self, dim: int, layers: int, causal: bool) -> None:
        super().__init__()
        self.resnets = nn.ModuleList(ResnetBlock(dim, dim, causal=causal) for _ in range(layers))

    def forward(self, x: Tensor) -> Tensor:
        for resnet in self.resnets:
            x = resnet(x)
        return x


class Encoder(nn.Module):
    def __init__(self, widths: Sequence[int]) -> None:
        super().__init__()
        layers = LTX_VAE_CONFIG["layers_per_block"]
        scaling = LTX_VAE_CONFIG["spatio_temporal_scaling"]
        self.conv_in = CausalConv3d(3 * PATCH * PATCH, widths[0])
        self.down_blocks = nn.ModuleList(
            DownBlock(widths[i], widths[min(i + 1, len(widths) - 1)], layers[i], scaling[i]) for i in range(len(widths)))
        self.mid_block = MidBlock(widths[-1], layers[-1], causal=True)
        self.conv_out = CausalConv3d(widths[-1], LATENT_CHANNELS + 1)  # means + one shared log-variance

    def forward(self, frames: Tensor) -> Tensor:
        b, c, t, h, w = frames.shape
        # 4x4 patches -> channels, ordered (colour, patch column, patch row) as the weights expect.
        x = frames.reshape(b, c, t, h // PATCH, PATCH, w // PATCH, PATCH).permute(0, 1, 6, 4, 2, 3, 5)
        x = self.conv_in(x.reshape(b, c * PATCH * PATCH, t, h // PATCH, w // PATCH))
        for block in self.down_blocks:
            x = block(x)
        return self.conv_out(F.silu(_rms(self.mid_block(x))))


class Decoder(nn.Module):
    def __init__(self, widths: Sequence[int]) -> None:
        super().__init__()
        widths = widths[::-1]
        layers = LTX_VAE_CONFIG["layers_per_block"][::-1]
        scaling = LTX_VAE_CONFIG["spatio_temporal_scaling"][::-1]
        self.conv_in = CausalConv3d(LATENT_CHANNELS, widths[0], causal=False)
        self.mid_block = MidBlock(widths[0], layers[0], causal=False)
        self.up_blocks = nn.ModuleList(
            UpBlock(widths[max(i - 1, 0)], widths[i], layers[i + 1], scaling[i]) for i in range(len(widths)))
        self.conv_out = CausalConv3d(widths[-1], 3 * PATCH * PATCH, causal=False)

    def forward(self, z: Tensor) -> Tensor:
        x = self.mid_block(self.conv_in(z))
        for block in self.up_blocks:
            x = block(x)
        x = self.conv_out(F.silu(_rms(x)))
        b, _, t, h, w = x.shape
        x = x.reshape(b, 3, PATCH, PATCH, t, h, w).permute(0, 1, 4, 5, 3, 6, 2)  # channels -> 4x4 patches
        return x.reshape(b, 3, t, h * PATCH, w * PATCH)


class LtxVAE(nn.Module):
    """Encoder + decoder + the latent statistics stored with the weights. Build, then ``load_ltx_vae``.
    ``width``: the channels as a fraction of the released VAE's (1); a narrower one has the same
    architecture and latents, for checks on a CPU with random weights."""

    def __init__(self, width: float = 1.0) -> None:
        super().__init__()
        widths = [round(w * width) for w in LTX_VAE_CONFIG["block_out_channels"]]
        if min(widths) < 1:
            raise ValueError(f"an LTX VAE width of {width} leaves a block without channels: {widths}")
        self.encoder = Encoder(widths)
        self.decoder = Decoder(widths)
        self.register_buffer("latents_mean", torch.zeros(LATENT_CHANNELS))
        self.register_buffer("latents_std", torch.ones(LATENT_CHANNELS))

    def _stats(self) -> tuple[Tensor, Tensor]:
        shape = (1, LATENT_CHANNELS, 1, 1, 1)
        return self.latents_mean.float().view(shape), self.latents_std.float().view(shape)

    def decode_chunk(self, latents: Tensor) -> Tensor:
        """Normalised latents ``(B, 128, T, h, w)`` -> frames ``(B, 3, 1 + 8 * (T - 1), 32h, 32w)``, float in
        about [-1, 1] (not clamped, as FlashHead Lite leaves them) in the model's dtype."""
        if latents.ndim != 5 or latents.shape[1] != LATENT_CHANNELS:
            raise ValueError(f"latents must be (B, {LATENT_CHANNELS}, T, h, w), got {tuple(latents.shape)}")
        mean, std = self._stats()
        z = (latents.float() * std + mean).to(self.decoder.conv_in.conv.weight.dtype)
        return self.decoder(z)

    def latent_shape(self, frames_shape: Sequence[int]) -> tuple[int, int, int, int, int]:
        """The latents' shape ``(B, 128, 1 + k, H / 32, W / 32)`` of frames shaped ``(B, 3, 1 + 8k, H, W)``."""
        b, _, f, h, w = frames_shape
        return b, LATENT_CHANNELS, 1 + (f - 1) // TEMPORAL_STRIDE, h // SPATIAL_STRIDE, w // SPATIAL_STRIDE

    def encode_motion(self, frames: Tensor, noise: Tensor | None = None) -> Tensor:
        """Frames ``(B, 3, 1 + 8k, H, W)`` in [-1, 1] -> normalised latents ``(B, 128, 1 + k, H / 32, W / 32)`` in
        float32: the posterior mean, or with ``noise`` (standard normal, ``latent_shape(frames.shape)``) a sample
        from the posterior (what FlashHead Lite feeds back as motion latents)."""
        f = frames.shape[2] if frames.ndim == 5 else 0
        if frames.ndim != 5 or frames.shape[1] != 3 or f % TEMPORAL_STRIDE != 1:
            raise ValueError(f"frames must be (B, 3, 1 + 8k, H, W), got {tuple(frames.shape)}")
        if frames.shape[3] % SPATIAL_STRIDE or frames.shape[4] % SPATIAL_STRIDE:
            raise ValueError(f"frame height and width must be multiples of {SPATIAL_STRIDE}, got {tuple(frames.shape)}")
        out = self.encoder(frames.to(self.encoder.conv_in.conv.weight.dtype)).float()
        z = out[:, :LATENT_CHANNELS]
        if noise is not None:
            z = z + torch.exp(0.5 * out[:, LATENT_CHANNELS:].clamp(-30.0, 20.0)) * noise
        mean, std = self._stats()
        return (z - mean) / std


def _check_config(path: Path) -> None:
    if not path.is_file():
        raise CheckpointError(path, "file not found")
    try:
        config = json.loads(path.read_text())
    except ValueError as e:
        raise CheckpointError(path, f"unreadable JSON: {e}") from None
    for key, expected in (LTX_VAE_CONFIG | _OPTIONAL_DEFAULTS).items():
        found = config.get(key, _OPTIONAL_DEFAULTS.get(key, "(absent)"))
        if found != expected:
            raise CheckpointError(path, f"not the LTX-Video 0.9.0 VAE FlashHead Lite uses: {key} is {found!r}, "
                                        f"expected {expected!r}")


def load_ltx_vae(folder: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> LtxVAE:
    """Our LTX VAE from the diffusers-style ``VAE_LTX/`` folder, in eval mode, weights in ``dtype`` on ``device``
    (latent statistics float32). Raises ``CheckpointError`` naming the file on any mismatch."""
    folder = Path(folder)
    _check_config(folder / "config.json")
    weights = folder / "diffusion_pytorch_model.safetensors"
    found = safetensors_shapes(weights)
    with torch.device("meta"):
        vae = LtxVAE()
    check_shapes(weights, found, {k: tuple(v.shape) for k, v in vae.state_dict().items()})
    state = load_file(weights, device=str(device))
    stats = {"latents_mean", "latents_std"}
    vae.load_state_dict({k: v.to(dtype=torch.float32 if k in stats else dtype) for k, v in state.items()},
                        strict=True, assign=True)
    return vae.eval().requires_grad_(False)


def random_ltx_vae(seed: int, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                   width: float = 1.0) -> LtxVAE:
    """Seeded random weights of the LTX VAE (PyTorch's initialisation), zero-mean unit-std latent statistics;
    ``width`` as ``LtxVAE``'s."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = LtxVAE(width)
    vae = vae.to(device, dtype)
    vae.latents_mean, vae.latents_std = vae.latents_mean.float(), vae.latents_std.float()
    return vae.eval().requires_grad_(False)

