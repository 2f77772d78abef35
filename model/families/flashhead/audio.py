"""FlashHead's audio path: 16 kHz speech -> wav2vec2-base features at 25 fps -> 32 tokens per latent frame.

wav2vec2's convolutional features (50 per second) are linearly interpolated to the video frame count
*before* its transformer, and all 12 hidden layers are kept: (frames, 12, 768). Each video frame reads a
5-frame window around it (clamped at the context's edges), and the adapter (the checkpoint's
``audio_proj.*``) maps a chunk's windows to ``audio_tokens`` tokens of width d per latent frame: the
first latent from its frame's full window, each later latent from its group of VAE-stride frames.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from charstream.model.families.flashhead.config import FlashHeadConfig


def normalise_speech(samples: Tensor) -> Tensor:
    """Zero mean, unit variance over each whole context (the last dimension), as wav2vec2-base-960h's
    feature extractor does."""
    samples = samples.double()
    mean = samples.mean(-1, keepdim=True)
    return ((samples - mean) / torch.sqrt(samples.var(-1, unbiased=False, keepdim=True) + 1e-7)).float()


class SpeechFeatures(nn.Module):
    """wav2vec2 (transformers' ``Wav2Vec2Model``) with its features resampled to the video frame rate."""

    def __init__(self, wav2vec2: nn.Module) -> None:
        super().__init__()
        self.wav2vec2 = wav2vec2.eval()

    @torch.no_grad()
    def forward(self, samples: Tensor, n_frames: int) -> Tensor:
        """samples (n,) at 16 kHz -> (n_frames, layers, 768): every hidden layer's output per video frame;
        a batch of contexts (batch, n) -> (batch, n_frames, layers, 768)."""
        model = self.wav2vec2
        dtype = model.feature_projection.projection.weight.dtype
        batch = normalise_speech(samples.reshape(-1, samples.shape[-1]))
        conv = model.feature_extractor(batch.to(model.device, dtype))  # (batch, 512, T)
        conv = F.interpolate(conv.float(), size=n_frames, mode="linear", align_corners=True).to(dtype)
        hidden, _ = model.feature_projection(conv.transpose(1, 2))
        encoder = model.encoder
        hidden = encoder.layer_norm(hidden + encoder.pos_conv_embed(hidden))
        layers = []
        for layer in encoder.layers:
            hidden = layer(hidden, attention_mask=None)
            layers.append(hidden)
        features = torch.stack(layers, dim=2)
        return features[0] if samples.dim() == 1 else features


def frame_windows(features: Tensor, start: int, end: int, window: int) -> Tensor:
    """(end - start, window, layers, 768) features of each frame in [start, end) and its neighbours,
    clamped to [0, end - 1] (a frame at the context's newest edge repeats itself for the future it lacks),
    from (frames, layers, 768); from a batch (batch, frames, layers, 768), the same per row."""
    offsets = torch.arange(window, device=features.device) - window // 2
    index = (torch.arange(start, end, device=features.device)[:, None] + offsets).clamp(0, end - 1)
    return features[..., index, :, :]


class AudioAdapter(nn.Module):
    """A chunk's per-frame audio windows -> ``audio_tokens`` tokens per latent frame."""

    def __init__(self, cfg: FlashHeadConfig) -> None:
        super().__init__()
        self.cfg = cfg
        per_frame = cfg.audio_layers * cfg.audio_dim
        self.first_in = nn.Linear(cfg.audio_window * per_frame, cfg.adapter_dim)
        self.grouped_in = nn.Linear(cfg.grouped_window * per_frame, cfg.adapter_dim)
        self.hidden = nn.Linear(cfg.adapter_dim, cfg.adapter_dim)
        self.tokens_out = nn.Linear(cfg.adapter_dim, cfg.audio_tokens * cfg.dim)
        self.norm = nn.LayerNorm(cfg.dim)

    def grouped_windows(self, windows: Tensor) -> Tensor:
        """(batch, frames, window, ...) -> (batch, later latents, grouped window, ...): within each group of
        VAE-stride frames the first keeps its window up to the centre, the last from the centre on, the
        ones between only their centre."""
        mid = self.cfg.audio_window // 2
        groups = windows[:, 1:].unflatten(1, (-1, self.cfg.vae_stride[0]))
        parts = [groups[:, :, 0, : mid + 1], groups[:, :, 1:-1, mid], groups[:, :, -1, mid:]]
        return torch.cat(parts, dim=2)

    def forward(self, windows: Tensor) -> Tensor:
        """windows (batch, frames_per_chunk, window, layers, 768) -> (batch, latents, tokens, d)."""
        dtype = self.first_in.weight.dtype
        windows = windows.to(dtype)
        first = F.relu(self.first_in(windows[:, :1].flatten(2)))
        later = F.relu(self.grouped_in(self.grouped_windows(windows).flatten(2)))
        hidden = F.relu(self.hidden(torch.cat([first, later], dim=1)))
        tokens = self.tokens_out(hidden).unflatten(-1, (self.cfg.audio_tokens, self.cfg.dim))
        # the released model normalises its tokens in fp32 whatever the weights' dtype
        normed = F.layer_norm(tokens.float(), (self.cfg.dim,), self.norm.weight.float(), self.norm.bias.float(), self.norm.eps)
        return normed.to(dtype)


ADAPTER_KEY_MAP = {
    f"{ours}.{kind}": f"audio_proj.{theirs}.{kind}"
    for ours, theirs in (
        ("first_in", "proj1"),
        ("grouped_in", "proj1_vf"),
        ("hidden", "proj2"),
        ("tokens_out", "proj3"),
        ("norm", "norm"),
    )
    for kind in ("weight", "bias")
}  # our parameter names -> the checkpoint's


class RollingSpeech:
    """The last ``audio_context_s`` seconds of speech (silence at first), re-encoded every chunk: the
    chunk's frames are the context's newest ``frames_per_chunk`` frames."""

    def __init__(self, cfg: FlashHeadConfig) -> None:
        self.cfg = cfg
        self._samples = torch.zeros(cfg.sample_rate * cfg.audio_context_s, dtype=torch.float64)

    @property
    def samples_per_chunk(self) -> int:
        return self.cfg.new_frames_per_chunk * self.cfg.sample_rate // self.cfg.fps

    def push(self, samples: Tensor) -> None:
        if samples.numel() != self.samples_per_chunk:
            raise ValueError(f"a chunk is {self.samples_per_chunk} samples of speech, got {samples.numel()}")
        self._samples = torch.cat([self._samples[samples.numel() :], samples.double().flatten()])

    def windows(self, features: SpeechFeatures) -> Tensor:
        """(1, frames_per_chunk, window, layers, 768): the current chunk's audio windows."""
        cfg = self.cfg
        total = cfg.audio_context_s * cfg.fps
        encoded = features(self._samples, total)
        return frame_windows(encoded, total - cfg.frames_per_chunk, total, cfg.audio_window)[None]
