"""The Wan2.1 video VAE of SoulX-FlashHead Pro: 16 latent channels, x4 in time, x8 in space.

Layouts and contracts:
- frames: ``(B, 3, F, H, W)`` float in [-1, 1], ``F = 1 + 4 * k`` (the first frame alone makes the first latent);
- latents: ``(B, 16, 1 + k, H / 8, W / 8)``, normalised per channel (``(mu - LATENT_MEAN) / LATENT_STD``), the
  DiT's space.

The reference implementation runs its causal 3-D convs one latent frame (decode) or four frames (encode) at a
time, carrying each conv's last two input frames in a cache that starts empty (zeros) every call. Every temporal
mixing layer is a causal conv with zero history, and everything else (RMS norm over channels, SiLU, 2-D convs,
per-frame attention) works frame by frame, so running the whole clip through each layer at once with two zero
frames of causal padding in front is the same function. The one exception is the first frame, which the reference
never mixes in time at the resampling layers:
- decoder, temporal upsampling: latent frame 0 yields one frame, every later frame two, made by a causal conv over
  frames 1.. alone (frame 0 is not in their history);
- encoder, temporal downsampling: frame 0 passes through, then a kernel-3 stride-2 conv over all frames (frame 0
  included) gives one frame per two.
Both are done here on the whole clip; ``decode_chunk``/``encode_motion`` are therefore a fresh cache per call,
which is what FlashHead does every chunk. ``decode_part`` decodes a clip in parts, in turn: each causal conv
takes its history from the part before's last input frames (a ``History``) instead of zeros, so the parts
are the whole clip's decode, and a clip's first frames can be shown before its last are decoded.

Speed: activations are channels-last (N, T, H, W, C in memory), so each conv is one cuDNN implicit-GEMM call over
the clip and every 2-D op runs on a free ``(B*T, C, H, W)`` view; the norm + SiLU + causal padding in front of each
conv are pointwise, so ``torch.compile(vae.decode_chunk, dynamic=False)`` fuses them into one pass (the convs stay
cuDNN's; with ``torch.backends.cudnn.benchmark`` on, cuDNN picks its fastest kernel per shape). The 3x3x3 convs are
nearly all of the work (about 70 TFLOP per 33-frame 512x512 chunk), so the decode is bound by cuDNN's conv rate.

Weights load from the original Wan2.1 ``.pth`` key space (``Wan2.1_VAE.pth``) through ``WAN_KEY_MAP``.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from charstream.model.families.flashhead.vae_files import check_shapes, load_torch_zip

Z_DIM = 16
BASE_DIM = 96  # the released VAE's base channels (x1, 2, 4, 4 by level)
TEMPORAL_STRIDE = 4
SPATIAL_STRIDE = 8
# Per-channel statistics of the encoder's posterior mean (Wan2.1): the DiT sees (mu - mean) / std.
LATENT_MEAN = (-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
               0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921)
LATENT_STD = (2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
              3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160)

# Original Wan2.1 key -> ours, applied in order (the original names its layers by position in nn.Sequential).
WAN_KEY_MAP: tuple[tuple[str, str], ...] = (
    (r"\.residual\.0\.", ".norm1."),
    (r"\.residual\.2\.", ".conv1."),
    (r"\.residual\.3\.", ".norm2."),
    (r"\.residual\.6\.", ".conv2."),
    (r"\.resample\.1\.", ".conv."),
    (r"^(encoder|decoder)\.head\.0\.", r"\1.head_norm."),
    (r"^(encoder|decoder)\.head\.2\.", r"\1.head_conv."),
    (r"^(encoder|decoder)\.conv1\.", r"\1.conv_in."),
    (r"^conv1\.", "quant_conv."),
    (r"^conv2\.", "post_quant_conv."),
)


def ours_from_wan_key(key: str) -> str:
    for pattern, replacement in WAN_KEY_MAP:
        key = re.sub(pattern, replacement, key)
    return key


def _per_frame(fn, x: Tensor) -> Tensor:
    """Apply a 2-D op to every frame of ``(B, C, T, H, W)``; a view both ways when ``x`` is channels-last."""
    b, t = x.shape[0], x.shape[2]
    y = fn(x.transpose(1, 2).flatten(0, 1))
    return y.unflatten(0, (b, t)).transpose(1, 2)


class History:
    """The causal convs' input frames in time, carried from one part of a clip to the next: ``before``, each
    conv's last input frames in the part before, in the order the convs run (None: the clip's first part,
    zeros in front); ``after``, the same from this part, gathered as it runs when ``keep`` is set."""

    def __init__(self, before: tuple[Tensor, ...] | None = None, keep: bool = False) -> None:
        self.before, self.keep, self.after = before, keep, []
        self._used = 0

    @property
    def first(self) -> bool:
        return self.before is None

    def pad(self, x: Tensor, frames: int) -> Tensor:
        """``x`` with ``frames`` frames in front: the part before's, or zeros."""
        if self.before is None:
            padded = F.pad(x, (0, 0, 0, 0, frames, 0))
        else:
            front = self.before[self._used]
            if front.shape[2] != frames:
                raise ValueError(f"history {self._used} has {front.shape[2]} frames, its conv takes {frames}")
            padded = torch.cat([front, x], dim=2)
        self._used += 1
        if self.keep:  # a copy: a view would keep the whole padded input alive
            self.after.append(padded[:, :, -frames:].clone(memory_format=torch.channels_last_3d))
        return padded


class CausalConv3d(nn.Conv3d):
    """A 3-D conv whose output frame t sees input frames t-k+1..t: zeros (or a ``History``) in front in
    time, centred in space."""

    def __init__(self, in_dim: int, out_dim: int, kernel: int | tuple[int, int, int],
                 stride: tuple[int, int, int] = (1, 1, 1), causal: bool = True) -> None:
        kt, kh, kw = (kernel,) * 3 if isinstance(kernel, int) else kernel
        super().__init__(in_dim, out_dim, (kt, kh, kw), stride=stride, padding=(0, kh // 2, kw // 2))
        self.history = kt - 1 if causal else 0

    def forward(self, x: Tensor, history: History | None = None) -> Tensor:
        if self.history:
            x = F.pad(x, (0, 0, 0, 0, self.history, 0)) if history is None else history.pad(x, self.history)
        return super().forward(x)


class RMSNorm(nn.Module):
    """Normalise each position's channel vector to unit RMS, times a per-channel gain (Wan's ``RMS_norm``)."""

    def __init__(self, dim: int, spatial_dims: int) -> None:
        super().__init__()
        self.scale = dim**0.5
        self.gamma = nn.Parameter(torch.ones(dim, *(1,) * spatial_dims))

    def forward(self, x: Tensor) -> Tensor:
        return F.normalize(x, dim=1) * (self.gamma * self.scale)  # one pass over x, not two


class ResidualBlock(nn.Module):
    def __init__(self, in_dim: int, out_dim: int) -> None:
        super().__init__()
        self.norm1 = RMSNorm(in_dim, 3)
        self.conv1 = CausalConv3d(in_dim, out_dim, 3)
        self.norm2 = RMSNorm(out_dim, 3)
        self.conv2 = CausalConv3d(out_dim, out_dim, 3)
        self.shortcut = CausalConv3d(in_dim, out_dim, 1) if in_dim != out_dim else nn.Identity()

    def forward(self, x: Tensor, history: History | None = None) -> Tensor:
        h = self.conv1(F.silu(self.norm1(x)), history)
        h = self.conv2(F.silu(self.norm2(h)), history)
        return self.shortcut(x) + h


class AttentionBlock(nn.Module):
    """Single-head self-attention over each frame's pixels (no mixing in time)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = RMSNorm(dim, 2)
        self.to_qkv = nn.Conv2d(dim, dim * 3, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def _frames(self, x: Tensor) -> Tensor:
        n, c, h, w = x.shape
        tokens = self.norm(x).permute(0, 2, 3, 1).reshape(n, 1, h * w, c)
        q, k, v = F.linear(tokens, self.to_qkv.weight.flatten(1), self.to_qkv.bias).chunk(3, dim=-1)
        out = F.linear(F.scaled_dot_product_attention(q, k, v), self.proj.weight.flatten(1), self.proj.bias)
        return out.reshape(n, h, w, c).permute(0, 3, 1, 2)

    def forward(self, x: Tensor, history: History | None = None) -> Tensor:
        return x + _per_frame(self._frames, x)  # frame by frame: no history


# Nearest x2 then a 3x3 conv == per output phase (row parity a, column parity b) a 2x2 conv of the input: along
# each axis the 3 taps fall on 2 input pixels, phase 0 on (i-1, i) with taps (0 | 1+2), phase 1 on (i, i+1) with
# taps (0+1 | 2). One 2x2 conv (padding 1) computes all four phases; phase (a, b) sits at offset (a, b).


def phase_taps(device: torch.device) -> Tensor:
    """(phase a, input pixel y, tap k) -> 1 where tap k falls on pixel y: pixel 0 takes taps k <= a, pixel 1 the
    rest. Made on ``device`` (no host tensor to copy: the decode may run inside a CUDA graph)."""
    first = (torch.arange(3, device=device)[None] <= torch.arange(2, device=device)[:, None]).float()
    return torch.stack([first, 1 - first], dim=1)


class Upsample(nn.Module):
    """x2 in space (nearest, then a 3x3 conv halving the channels); with ``temporal``, first x2 in time.

    The spatial step runs as the equal sub-pixel conv above: 16 instead of 36 multiply-adds per input pixel and
    channel pair, and the x4 larger nearest-upsampled input is never materialised."""

    def __init__(self, dim: int, temporal: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(dim, dim // 2, 3, padding=1)
        self.time_conv = CausalConv3d(dim, dim * 2, (3, 1, 1)) if temporal else None

    def _spatial(self, x: Tensor) -> Tensor:
        w = self.conv.weight
        taps = phase_taps(w.device)
        # (a, b, out, in, 2, 2): row taps of phase a, column taps of phase b, summed in float32.
        phases = torch.einsum("ayk,oikl,bxl->aboiyx", taps, w.float(), taps).flatten(0, 2).to(w.dtype)
        y = F.conv2d(x, phases.contiguous(memory_format=torch.channels_last), self.conv.bias.repeat(4), padding=1)
        n, c, h, wd = x.shape
        out_c = w.shape[0]
        out = torch.empty(n, out_c, 2 * h, 2 * wd, dtype=y.dtype, device=y.device, memory_format=torch.channels_last)
        for a in (0, 1):
            for b in (0, 1):
                out[:, :, a::2, b::2] = y[:, (2 * a + b) * out_c:(2 * a + b + 1) * out_c, a:a + h, b:b + wd]
        return out

    def forward(self, x: Tensor, history: History | None = None) -> Tensor:
        first = history is None or history.first  # the clip's frame 0 is in x
        if self.time_conv is not None and (x.shape[2] > 1 or not first):
            b, c, t, h, w = x.shape
            # Each later frame -> two (the conv's two channel halves, interleaved in time); frame 0 stays one,
            # and is not in the later frames' history.
            later = x[:, :, 1:] if first else x
            pairs = self.time_conv(later, history).unflatten(1, (2, c))
            doubled = pairs.permute(0, 2, 3, 1, 4, 5).reshape(b, c, 2 * later.shape[2], h, w)
            x = torch.cat([x[:, :, :1], doubled], dim=2) if first else doubled
        return _per_frame(self._spatial, x)


class Downsample(nn.Module):
    """/2 in space (a stride-2 3x3 conv, zero pad right and bottom); with ``temporal``, then /2 in time."""

    def __init__(self, dim: int, temporal: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(dim, dim, 3, stride=2)
        self.time_conv = CausalConv3d(dim, dim, (3, 1, 1), stride=(2, 1, 1), causal=False) if temporal else None

    def _spatial(self, x: Tensor) -> Tensor:
        return self.conv(F.pad(x, (0, 1, 0, 1)))

    def forward(self, x: Tensor) -> Tensor:
        x = _per_frame(self._spatial, x)
        if self.time_conv is not None and x.shape[2] > 1:
            x = torch.cat([x[:, :, :1], self.time_conv(x)], dim=2)
        return x


class Encoder(nn.Module):
    def __init__(self, dim: int = BASE_DIM, z_dim: int = 2 * Z_DIM, dim_mult: tuple[int, ...] = (1, 2, 4, 4),
                 num_res_blocks: int = 2, temporal_downsample: tuple[bool, ...] = (False, True, True)) -> None:
        super().__init__()
        dims = [dim * m for m in (1, *dim_mult)]
        self.conv_in = CausalConv3d(3, dims[0], 3)
        layers: list[nn.Module] = []
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
            for _ in range(num_res_blocks):
                layers.append(ResidualBlock(in_dim, out_dim))
                in_dim = out_dim
            if i != len(dim_mult) - 1:
                layers.append(Downsample(out_dim, temporal_downsample[i]))
        self.downsamples = nn.Sequential(*layers)
        self.middle = nn.Sequential(ResidualBlock(dims[-1], dims[-1]), AttentionBlock(dims[-1]),
                                    ResidualBlock(dims[-1], dims[-1]))
        self.head_norm = RMSNorm(dims[-1], 3)
        self.head_conv = CausalConv3d(dims[-1], z_dim, 3)

    def forward(self, x: Tensor) -> Tensor:
        x = self.middle(self.downsamples(self.conv_in(x)))
        return self.head_conv(F.silu(self.head_norm(x)))


class Decoder(nn.Module):
    def __init__(self, dim: int = BASE_DIM, z_dim: int = Z_DIM, dim_mult: tuple[int, ...] = (1, 2, 4, 4),
                 num_res_blocks: int = 2, temporal_upsample: tuple[bool, ...] = (True, True, False)) -> None:
        super().__init__()
        dims = [dim * m for m in (dim_mult[-1], *dim_mult[::-1])]
        self.conv_in = CausalConv3d(z_dim, dims[0], 3)
        self.middle = nn.Sequential(ResidualBlock(dims[0], dims[0]), AttentionBlock(dims[0]),
                                    ResidualBlock(dims[0], dims[0]))
        layers: list[nn.Module] = []
        for i, (in_dim, out_dim) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
            if i > 0:
                in_dim //= 2  # the upsampling conv before this level halved the channels
            for _ in range(num_res_blocks + 1):
                layers.append(ResidualBlock(in_dim, out_dim))
                in_dim = out_dim
            if i != len(dim_mult) - 1:
                layers.append(Upsample(out_dim, temporal_upsample[i]))
        self.upsamples = nn.Sequential(*layers)
        self.head_norm = RMSNorm(dims[-1], 3)
        self.head_conv = CausalConv3d(dims[-1], 3, 3)

    def forward(self, z: Tensor, history: History | None = None) -> Tensor:
        x = self.conv_in(z, history)
        for layer in (*self.middle, *self.upsamples):
            x = layer(x, history)
        return self.head_conv(F.silu(self.head_norm(x)), history)


class WanVAE(nn.Module):
    """Encoder + decoder + latent normalisation. Build, then ``load_wan_vae`` (or ``load_state_dict``).
    ``width``: the channels as a fraction of the released VAE's (1); a narrower one has the same
    architecture and latents, for checks on a CPU with random weights."""

    def __init__(self, width: float = 1.0) -> None:
        super().__init__()
        dim = round(BASE_DIM * width)
        if dim < 2 or dim % 2:
            raise ValueError(f"a Wan VAE width of {width} gives {dim} base channels: an even number >= 2 is needed")
        self.encoder = Encoder(dim)
        self.quant_conv = CausalConv3d(2 * Z_DIM, 2 * Z_DIM, 1)
        self.post_quant_conv = CausalConv3d(Z_DIM, Z_DIM, 1)
        self.decoder = Decoder(dim)
        self.register_buffer("latent_mean", torch.tensor(LATENT_MEAN).view(1, Z_DIM, 1, 1, 1), persistent=False)
        self.register_buffer("latent_std", torch.tensor(LATENT_STD).view(1, Z_DIM, 1, 1, 1), persistent=False)

    def decode_chunk(self, latents: Tensor) -> Tensor:
        """Normalised latents ``(B, 16, T, h, w)`` -> frames ``(B, 3, 1 + 4 * (T - 1), 8h, 8w)``, float in
        [-1, 1] in the model's dtype, channels-last in memory. Fresh causal history (zeros) at the first latent."""
        return self._decode(latents, None)

    def decode_part(self, latents: Tensor, history: tuple[Tensor, ...] | None = None,
                    last: bool = False) -> tuple[Tensor, tuple[Tensor, ...]]:
        """One part of a clip's latents decoded, continuing the part before: ``history`` is what that part
        returned (None: this is the clip's first part, which must hold at least two latents). Returns the
        part's frames (its first part's ``1 + 4 * (T - 1)``, a later part's ``4 * T``) and the history for the
        next part (none after the ``last``). Parts decoded in turn give the frames ``decode_chunk`` gives."""
        if history is None and latents.ndim == 5 and latents.shape[2] < 2:
            raise ValueError(f"a clip's first part holds at least 2 latents, got {tuple(latents.shape)}")
        carried = History(history, keep=not last)
        return self._decode(latents, carried), tuple(carried.after)

    def decode_lead(self, latents: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
        """A clip's first part: its frames and the history its next part continues from (``decode_part``).
        The served two-part decode compiles this and ``decode_rest`` apart: each is one compilation per
        shape, where ``decode_part``'s history and ``last`` would each add guards to one."""
        return self.decode_part(latents)

    def decode_rest(self, latents: Tensor, history: tuple[Tensor, ...]) -> Tensor:
        """A clip's last part, continuing the part before from its ``history``: its frames."""
        return self.decode_part(latents, history, last=True)[0]

    def _decode(self, latents: Tensor, history: History | None) -> Tensor:
        if latents.ndim != 5 or latents.shape[1] != Z_DIM:
            raise ValueError(f"latents must be (B, {Z_DIM}, T, h, w), got {tuple(latents.shape)}")
        z = latents.to(self.latent_std.dtype) * self.latent_std + self.latent_mean
        z = z.to(self.post_quant_conv.weight.dtype).contiguous(memory_format=torch.channels_last_3d)
        return self.decoder(self.post_quant_conv(z), history).clamp_(-1.0, 1.0)

    def encode_motion(self, frames: Tensor) -> Tensor:
        """Frames ``(B, 3, 1 + 4k, H, W)`` in [-1, 1] -> normalised latents ``(B, 16, 1 + k, H / 8, W / 8)``, the
        posterior mean (as FlashHead Pro uses), in float32. Fresh causal history at the first frame."""
        f = frames.shape[2] if frames.ndim == 5 else 0
        if frames.ndim != 5 or frames.shape[1] != 3 or f % TEMPORAL_STRIDE != 1:
            raise ValueError(f"frames must be (B, 3, 1 + 4k, H, W), got {tuple(frames.shape)}")
        if frames.shape[3] % SPATIAL_STRIDE or frames.shape[4] % SPATIAL_STRIDE:
            raise ValueError(f"frame height and width must be multiples of {SPATIAL_STRIDE}, got {tuple(frames.shape)}")
        x = frames.to(self.quant_conv.weight.dtype).contiguous(memory_format=torch.channels_last_3d)
        mu = self.quant_conv(self.encoder(x))[:, :Z_DIM]
        return (mu.to(self.latent_std.dtype) - self.latent_mean) / self.latent_std


def _channels_last(module: nn.Module) -> nn.Module:
    for p in module.parameters():
        if p.ndim in (4, 5):
            fmt = torch.channels_last if p.ndim == 4 else torch.channels_last_3d
            p.data = p.data.contiguous(memory_format=fmt)
    return module


def load_wan_vae(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32) -> WanVAE:
    """Our Wan VAE from ``Wan2.1_VAE.pth`` (original key space), in eval mode, weights in ``dtype`` on ``device``;
    the latent statistics stay float32. Raises ``CheckpointError`` naming the file on any mismatch."""
    path = Path(path)
    state = {ours_from_wan_key(k): v for k, v in load_torch_zip(path).items()}
    with torch.device("meta"):
        vae = WanVAE()
    check_shapes(path, {k: tuple(v.shape) for k, v in state.items()},
                 {k: tuple(v.shape) for k, v in vae.state_dict().items()})
    vae.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in state.items()}, strict=True, assign=True)
    vae.latent_mean = torch.tensor(LATENT_MEAN, device=device).view(1, Z_DIM, 1, 1, 1)
    vae.latent_std = torch.tensor(LATENT_STD, device=device).view(1, Z_DIM, 1, 1, 1)
    return _channels_last(vae.eval().requires_grad_(False))


def random_wan_vae(seed: int, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                   width: float = 1.0) -> WanVAE:
    """Seeded random weights of the Wan VAE (PyTorch's initialisation), laid out as ``load_wan_vae``'s;
    ``width`` as ``WanVAE``'s."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        vae = WanVAE(width).to(device, dtype)
    vae.latent_mean = torch.tensor(LATENT_MEAN, device=device).view(1, Z_DIM, 1, 1, 1)  # statistics stay float32
    vae.latent_std = torch.tensor(LATENT_STD, device=device).view(1, Z_DIM, 1, 1, 1)
    return _channels_last(vae.eval().requires_grad_(False))

