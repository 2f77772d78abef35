"""Causal video VAE: one latent frame <-> ``frames_per_chunk`` RGB frames, streamable.

Layouts (frames-major, so every spatial conv runs on a ``(B*T, C, H, W)`` view for free):
- video: ``(B, F, 3, H, W)`` float in [-1, 1], ``F = frames_per_chunk * T``
- latents: ``(B, T, C, h, w)``, normalised (the DiT's space; see ``Decoder.latent_mean/std``)

Causality lives only in time: every temporal mixing layer is a causal conv of kernel 3 whose
input history (the last 2 frames) is carried in a ``CausalState``. Decoding one latent frame at
a time with the state threaded through equals decoding the whole clip at once (zero history at
the start of a clip / session). States are immutable: a step returns a new one, so a snapshot
for rollback is just a reference to an old state.

Spatially the decoder is a plain conv net: channels-last activations, RMS norm over channels
(per pixel, so nothing mixes across time), SiLU, 3x3 convs, 1x1 conv + nearest 2x upsampling,
and a pixel-shuffle head that produces the last 2x (no conv ever runs at full resolution).

Training objective (``VideoVAE.loss``): KL-regularised autoencoder, L1 reconstruction +
``kl_weight`` * KL(q(z|x) || N(0, I)) with a small weight (default 1e-6), so the latents stay
close to an autoencoder's but bounded. After training, set the per-channel latent statistics
(``VideoVAE.set_latent_stats``) so the DiT sees unit-scale latents.

The reference (identity) frame is encoded as a still clip: the image repeated
``frames_per_chunk`` times -> one latent frame (``VideoVAE.encode_image``).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from charstream.model.config import ModelConfig

TEMPORAL_KERNEL = 3  # causal temporal kernel: each frame sees itself and the 2 frames before


def _nhwc(x: Tensor) -> Tensor:
    """(N, C, H, W) channels-last -> its (N, H, W, C) view (no copy)."""
    return x.permute(0, 2, 3, 1)


def _nchw(x: Tensor) -> Tensor:
    """(N, H, W, C) contiguous -> the (N, C, H, W) channels-last view (no copy)."""
    return x.permute(0, 3, 1, 2)


@dataclass(frozen=True)
class CausalState:
    """Temporal history of every causal layer: for each, its last 2 input frames (B, 2, H, W, C).

    ``None`` entries (and an empty state) mean zero history: the start of a clip or session.
    ``frames`` counts the latent frames this state has seen (for logs and checks).
    """

    caches: tuple[Tensor | None, ...] = ()
    frames: int = 0

    def nbytes(self) -> int:
        return sum(c.numel() * c.element_size() for c in self.caches if c is not None)


@dataclass
class _StateIO:
    """Threads caches through one forward: reads old ones in order, collects the new ones."""

    old: tuple[Tensor | None, ...]
    new: list[Tensor] = field(default_factory=list)

    def take(self) -> Tensor | None:
        i = len(self.new)
        return self.old[i] if i < len(self.old) else None


def conv_per_clip(conv: nn.Conv2d, x: Tensor, frames: int) -> Tensor:
    """``conv(x)`` for ``x`` holding clips of ``frames`` images each. On CPU at inference, one clip at a time:
    oneDNN picks its algorithm by batch size, so a batch of clips would differ in the low bits from each
    clip run alone, and sessions decoded together (model/batched_decoder.py) from each decoded by itself."""
    if not x.is_cpu or x.shape[0] == frames or torch.is_grad_enabled():
        return conv(x)
    return torch.cat([conv(clip) for clip in x.split(frames)])


class RMSNorm2d(nn.Module):
    """RMS norm over channels, per pixel and frame (causal by construction)."""

    def __init__(self, channels: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(channels))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return _nchw(F.rms_norm(_nhwc(x), (x.shape[1],), self.weight, self.eps))

    def silu(self, x: Tensor) -> Tensor:
        """``F.silu(self(x))``. On CPU without autograd in fewer passes over the activations: one reduction for
        the per-pixel RMS, one product by it, the weight and SiLU in place (the same math as F.rms_norm's)."""
        if torch.is_grad_enabled() or not x.is_cpu:  # CUDA (graphed decoder): unchanged
            return F.silu(self(x))
        xh = _nhwc(x)
        ms = torch.linalg.vector_norm(xh, dim=-1, keepdim=True).square_().div_(x.shape[1])
        y = xh * ms.add_(self.eps).rsqrt_()
        return _nchw(F.silu(y.mul_(self.weight), inplace=True))


class CausalTemporalConv(nn.Module):
    """Pointwise-in-space, causal-in-time conv: y_t = W [x_{t-2}, x_{t-1}, x_t] + b."""

    def __init__(self, channels: int):
        super().__init__()
        self.proj = nn.Linear(TEMPORAL_KERNEL * channels, channels)

    def forward(self, x: Tensor, frames: int, io: _StateIO) -> Tensor:
        n, c, h, w = x.shape
        xt = _nhwc(x).reshape(n // frames, frames, h, w, c)
        history = io.take()
        if history is None:
            history = xt.new_zeros(xt.shape[0], TEMPORAL_KERNEL - 1, h, w, c)
        full = torch.cat([history, xt], dim=1)  # (B, 2 + T, h, w, C)
        io.new.append(full[:, frames:].clone())  # the last 2 input frames, for the next call
        # One GEMM per tap, accumulated in place (cheaper than stacking the taps along channels).
        taps = self.proj.weight.split(c, dim=1)  # (C, C) each, oldest frame first
        y = F.linear(full[:, -frames:], taps[-1], self.proj.bias).reshape(-1, c)
        for d in range(TEMPORAL_KERNEL - 1):
            y.addmm_(full[:, d : d + frames].reshape(-1, c), taps[d].t())
        return _nchw(y.view(n, h, w, c))


class CausalResBlock(nn.Module):
    """x + temporal(act(norm(conv3x3(act(norm(x)))))): spatial mixing, then causal time mixing."""

    def __init__(self, channels: int):
        super().__init__()
        self.norm1 = RMSNorm2d(channels)
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)
        self.norm2 = RMSNorm2d(channels)
        self.temporal = CausalTemporalConv(channels)

    def forward(self, x: Tensor, frames: int, io: _StateIO) -> Tensor:
        h = conv_per_clip(self.conv, self.norm1.silu(x), frames)
        return self.temporal(self.norm2.silu(h), frames, io).add_(x)  # a fresh tensor: in place is safe


class Upsample(nn.Module):
    """1x1 conv to the finer level's width, then nearest 2x (the same as the other order, 4x cheaper);
    the next block's 3x3 conv does the spatial interpolation."""

    def __init__(self, c_in: int, c_out: int):
        super().__init__()
        self.proj = nn.Conv2d(c_in, c_out, 1)

    def forward(self, x: Tensor) -> Tensor:
        # the 1x1 conv as a GEMM over channels-last pixels (the conv's slow path would leave NCHW)
        y = _nchw(F.linear(_nhwc(x), self.proj.weight.flatten(1), self.proj.bias))
        return F.interpolate(y, scale_factor=2.0, mode="nearest")


def _pixel_shuffle_2x(x: Tensor) -> Tensor:
    """``F.pixel_shuffle(x, 2)`` of a channels-last (N, 4C, h, w) as one permuted copy into a channels-last
    (N, C, 2h, 2w) (pixel_shuffle itself is slow on channels-last input, and leaves it)."""
    if not x.is_contiguous(memory_format=torch.channels_last):
        return F.pixel_shuffle(x, 2)
    n, c4, h, w = x.shape
    c = c4 // 4
    # channel c * 4 + i * 2 + j of pixel (y, x) -> channel c of pixel (2y + i, 2x + j)
    y = _nhwc(x).view(n, h, w, c, 2, 2).permute(0, 1, 4, 2, 5, 3).reshape(n, 2 * h, 2 * w, c)
    return _nchw(y)


def _check_config(cfg: ModelConfig) -> int:
    levels = len(cfg.vae_channels)
    if cfg.vae_spatial != 2**levels:
        raise ValueError(
            f"VAE preset {cfg.name!r}: vae_spatial={cfg.vae_spatial} needs log2 = len(vae_channels) "
            f"= {levels} levels (each level is one 2x step)"
        )
    if cfg.height % cfg.vae_spatial or cfg.width % cfg.vae_spatial:
        raise ValueError(f"VAE preset {cfg.name!r}: {cfg.height}x{cfg.width} not divisible by {cfg.vae_spatial}")
    return levels


class Decoder(nn.Module):
    """Latent frames (B, T, C, h, w) -> video (B, T * frames_per_chunk, 3, H, W), causal in time."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        levels = _check_config(cfg)
        ch = cfg.vae_channels
        self.cfg = cfg
        self.frames_per_latent = cfg.frames_per_chunk
        self.latent_channels = cfg.latent_channels
        # Per-channel statistics of the encoder's latents: the DiT works in normalised space.
        self.register_buffer("latent_mean", torch.zeros(cfg.latent_channels))
        self.register_buffer("latent_std", torch.ones(cfg.latent_channels))
        self.conv_in = nn.Conv2d(cfg.latent_channels, ch[0], 3, padding=1)
        self.mid = CausalResBlock(ch[0])  # runs at latent frame rate: cheap temporal context
        self.time_expand = nn.Linear(ch[0], cfg.frames_per_chunk * ch[0])  # depth-to-time
        self.blocks = nn.ModuleList(CausalResBlock(c) for c in ch)
        self.ups = nn.ModuleList(Upsample(ch[i], ch[i + 1]) for i in range(levels - 1))
        self.norm_out = RMSNorm2d(ch[-1])
        self.conv_out = nn.Conv2d(ch[-1], 3 * 4, 3, padding=1)  # + pixel shuffle: the last 2x

    def forward(self, latents: Tensor, state: CausalState | None = None) -> tuple[Tensor, CausalState]:
        b, t, c, h, w = latents.shape
        if c != self.latent_channels:
            raise ValueError(f"decoder expects {self.latent_channels} latent channels, got {c}")
        io = _StateIO(state.caches if state is not None else ())
        z = latents * self.latent_std.view(1, 1, c, 1, 1) + self.latent_mean.view(1, 1, c, 1, 1)
        x = conv_per_clip(self.conv_in, z.reshape(b * t, c, h, w).contiguous(memory_format=torch.channels_last), t)
        x = self.mid(x, t, io)
        # depth-to-time: each latent frame's channels become frames_per_latent video frames
        k, ch = self.frames_per_latent, x.shape[1]
        y = self.time_expand(_nhwc(x)).reshape(b * t, h, w, k, ch)
        x = _nchw(y.permute(0, 3, 1, 2, 4).reshape(b * t * k, h, w, ch).contiguous())  # channels-last
        frames = t * k
        for i, block in enumerate(self.blocks):
            x = block(x, frames, io)
            if i < len(self.ups):
                x = self.ups[i](x)
        x = _pixel_shuffle_2x(conv_per_clip(self.conv_out, self.norm_out.silu(x), frames))
        video = x.reshape(b, frames, 3, x.shape[-2], x.shape[-1])
        prev = state.frames if state is not None else 0
        return video, CausalState(tuple(io.new), prev + t)

    def decode_chunk(self, latent: Tensor, state: CausalState | None = None) -> tuple[Tensor, CausalState]:
        """One latent frame (C, h, w) -> its frames (frames_per_chunk, 3, H, W) in [-1, 1] + new state."""
        video, state = self(latent[None, None], state)
        return video[0], state


class Encoder(nn.Module):
    """Video (B, F, 3, H, W), F = frames_per_chunk * T -> (mean, logvar), each (B, T, C, h, w)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        levels = _check_config(cfg)
        ch = cfg.vae_channels
        self.frames_per_latent = cfg.frames_per_chunk
        self.conv_in = nn.Conv2d(3 * 4, ch[-1], 3, padding=1)  # after pixel unshuffle: the first 2x
        self.blocks = nn.ModuleList(CausalResBlock(c) for c in reversed(ch))
        self.downs = nn.ModuleList(
            nn.Conv2d(ch[i], ch[i - 1], 3, stride=2, padding=1) for i in range(levels - 1, 0, -1)
        )
        self.time_compress = nn.Linear(cfg.frames_per_chunk * ch[0], ch[0])  # time-to-depth
        self.mid = CausalResBlock(ch[0])
        self.norm_out = RMSNorm2d(ch[0])
        self.conv_out = nn.Conv2d(ch[0], 2 * cfg.latent_channels, 3, padding=1)

    def forward(self, video: Tensor) -> tuple[Tensor, Tensor]:
        b, f, c, hh, ww = video.shape
        k = self.frames_per_latent
        if c != 3 or f % k:
            raise ValueError(f"encoder expects (B, {k}*T, 3, H, W) video, got {tuple(video.shape)}")
        io = _StateIO(())  # a training clip starts with zero history, as a session does
        x = F.pixel_unshuffle(video.reshape(b * f, 3, hh, ww), 2).contiguous(memory_format=torch.channels_last)
        x = self.conv_in(x)
        for i, block in enumerate(self.blocks):
            x = block(x, f, io)
            if i < len(self.downs):
                x = self.downs[i](x)
        t = f // k
        n, ch, h, w = x.shape
        y = _nhwc(x).reshape(b * t, k, h, w, ch).permute(0, 2, 3, 1, 4).reshape(b * t, h, w, k * ch)
        x = _nchw(self.time_compress(y))
        x = self.mid(x, t, io)
        moments = self.conv_out(self.norm_out.silu(x))
        moments = moments.reshape(b, t, *moments.shape[1:])
        mean, logvar = moments.chunk(2, dim=2)
        return mean, logvar.clamp(-30.0, 20.0)


class VideoVAE(nn.Module):
    """Encoder + decoder; ``loss`` is the training objective (see module docstring)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.encoder = Encoder(cfg)
        self.decoder = Decoder(cfg)

    def normalize(self, z: Tensor) -> Tensor:
        shape = (1, 1, -1, 1, 1)
        return (z - self.decoder.latent_mean.view(shape)) / self.decoder.latent_std.view(shape)

    def encode(self, video: Tensor) -> Tensor:
        """Video (B, 4T, 3, H, W) in [-1, 1] -> normalised latents (B, T, C, h, w) (posterior mean)."""
        return self.normalize(self.encoder(video)[0])

    def encode_image(self, image: Tensor) -> Tensor:
        """Reference image (B, 3, H, W) in [-1, 1] -> one normalised latent frame (B, C, h, w)."""
        still = image[:, None].expand(-1, self.cfg.frames_per_chunk, -1, -1, -1)
        return self.encode(still)[:, 0]

    def decode(self, latents: Tensor, state: CausalState | None = None) -> tuple[Tensor, CausalState]:
        return self.decoder(latents, state)

    @torch.no_grad()
    def set_latent_stats(self, mean: Tensor, std: Tensor) -> None:
        """Per-channel statistics of raw encoder latents (from training data); stored in the weights."""
        self.decoder.latent_mean.copy_(mean)
        self.decoder.latent_std.copy_(std.clamp_min(1e-6))

    def loss(self, video: Tensor, kl_weight: float = 1e-6) -> dict[str, Tensor]:
        """L1 reconstruction + kl_weight * KL, on raw (unnormalised) latents sampled from q(z|x)."""
        mean, logvar = self.encoder(video)
        z = mean + torch.randn_like(mean) * torch.exp(0.5 * logvar)
        recon, _ = self.decoder(self.normalize(z))
        rec = (recon - video).abs().mean()
        kl = 0.5 * (mean.square() + logvar.exp() - 1.0 - logvar).mean()
        return {"loss": rec + kl_weight * kl, "recon": rec, "kl": kl}


def to_uint8_frames(video: Tensor) -> Tensor:
    """(..., 3, H, W) float in [-1, 1] -> (..., H, W, 3) uint8 on the same device."""
    x = video.float().movedim(-3, -1)  # channels-last video (the CPU decoder's): a contiguous view
    # clamp makes the one new tensor; the rest in place on it (clamp's backward reads its input only)
    x = x.clamp(-1.0, 1.0).add_(1.0).mul_(127.5).round_()
    return x.to(torch.uint8).contiguous()


def time_decode(
    cfg: ModelConfig,
    steps: int = 20,
    warmup: int = 3,
    device: str = "cpu",
    dtype: torch.dtype = torch.float32,
    cpu_seconds: list[float] | None = None,
) -> list[float]:
    """Wall seconds per ``decode_chunk`` + uint8 conversion, streaming with the state, random weights.

    ``cpu_seconds``, if given, receives the process CPU time of each timed decode (all threads):
    on a shared machine it is not inflated by waiting for a core, as wall time is.
    """
    torch.manual_seed(0)
    decoder = Decoder(cfg).to(device=device, dtype=dtype).eval()
    shape = (cfg.latent_channels, cfg.latent_height, cfg.latent_width)
    state = None
    times = []
    with torch.inference_mode():
        for i in range(warmup + steps):
            latent = torch.randn(shape, device=device, dtype=dtype)
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t0, c0 = time.perf_counter(), time.process_time()
            video, state = decoder.decode_chunk(latent, state)
            to_uint8_frames(video).cpu()
            if i >= warmup:
                times.append(time.perf_counter() - t0)
                if cpu_seconds is not None:
                    cpu_seconds.append(time.process_time() - c0)
    return times


def to_video(frames_u8: torch.Tensor) -> torch.Tensor:
    """uint8 (..., 3, H, W) -> float in [-1, 1]."""
    return frames_u8.float() / 127.5 - 1.0
