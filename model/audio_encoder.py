"""Audio encoder: 48 kHz timeline audio -> per-chunk audio tokens (n_audio_tokens, audio_dim).

Chunk ``n``'s tokens are a function of one **window** of the timeline only:
``[n * 8000 - context, (n + 1) * 8000 + lookahead)`` (48 kHz samples; zeros before the session
start or where no audio exists), with ``context = audio_context_ms`` and ``lookahead =
audio_lookahead_ms``. Inside, the window is resampled to ``audio_rate`` (16 kHz) by a
Kaiser-windowed sinc low-pass evaluated only at the kept output samples (the polyphase form of
an integer decimation), turned into log-mel frames (``torch.stft``, 25 ms window, 10 ms hop), and
a small conv + transformer network pools the frames into the chunk's tokens with learned queries.

Only mel frames whose whole receptive field (STFT window + resampler taps) lies inside the window
are used, so nothing depends on where the window was cut: encoding a chunk from its streamed
window (``encode_window``) equals encoding it from the whole clip at once (``encode_clip``, which
filters the clip once and gathers every chunk's frames), to float rounding.

``rms_envelope`` is a cheap, model-free feature: the RMS level of each video frame's 2,000 samples.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from charstream.model.config import ModelConfig
from charstream.timeline import SAMPLES_PER_CHUNK, SAMPLES_PER_FRAME, TIMELINE_RATE

N_MELS = 80
WINDOW_MS = 25.0  # STFT window (Whisper-style front end)
HOP_MS = 10.0
_ZERO_CROSSINGS = 16  # sinc lobes each side: ~-80 dB stop band with the Kaiser window below
_KAISER_BETA = 8.6
_ROLLOFF = 0.94  # cutoff as a fraction of the output Nyquist: room for the transition band


def lowpass_taps(factor: int) -> Tensor:
    """Kaiser-windowed sinc low-pass for decimation by ``factor``; odd length, half width a multiple of ``factor``."""
    cutoff = _ROLLOFF / factor  # in units of the input Nyquist
    half = math.ceil(_ZERO_CROSSINGS / cutoff / factor) * factor
    t = torch.arange(-half, half + 1, dtype=torch.float64)
    window = torch.special.i0(_KAISER_BETA * torch.sqrt((1 - (t / (half + 1)) ** 2).clamp_min(0.0)))
    taps = cutoff * torch.sinc(cutoff * t) * window / torch.special.i0(torch.tensor(_KAISER_BETA, dtype=torch.float64))
    return (taps / taps.sum()).float()  # unit DC gain


def mel_filterbank(n_fft: int, sample_rate: int, n_mels: int = N_MELS, fmin: float = 20.0) -> Tensor:
    """Triangular HTK-mel filters, (n_mels, n_fft // 2 + 1), area-normalised (Slaney style)."""
    def hz_to_mel(f: float) -> float:
        return 2595.0 * math.log10(1.0 + f / 700.0)

    fmax = sample_rate / 2
    mels = torch.linspace(hz_to_mel(fmin), hz_to_mel(fmax), n_mels + 2)
    edges = 700.0 * (10.0 ** (mels / 2595.0) - 1.0)
    freqs = torch.linspace(0.0, fmax, n_fft // 2 + 1)
    lower, centre, upper = edges[:-2, None], edges[1:-1, None], edges[2:, None]
    rising = (freqs[None] - lower) / (centre - lower)
    falling = (upper - freqs[None]) / (upper - centre)
    fb = torch.clamp(torch.minimum(rising, falling), min=0.0)
    return fb * (2.0 / (upper - lower))


def _as_float_audio(audio: np.ndarray | Tensor) -> Tensor:
    """int16 (full scale 32768) or float [-1, 1] samples -> float32 tensor."""
    if isinstance(audio, np.ndarray):
        audio = torch.from_numpy(np.ascontiguousarray(audio))
    if audio.dtype == torch.int16:
        return audio.float() / 32768.0
    if not audio.is_floating_point():
        raise ValueError(f"audio must be int16 or float samples, got {audio.dtype}")
    return audio.float()


def _check_rate(sample_rate: int) -> None:
    if sample_rate != TIMELINE_RATE:
        raise ValueError(
            f"audio encoder takes {TIMELINE_RATE} Hz timeline audio, got {sample_rate} Hz "
            "(agent audio is resampled onto the timeline at ingest)"
        )


def rms_envelope(audio: np.ndarray | Tensor, sample_rate: int = TIMELINE_RATE) -> np.ndarray:
    """RMS level (full scale = 1.0) of each video frame's span of timeline audio, float32 (n_frames,).

    The last partial frame, if any, is zero-padded.
    """
    _check_rate(sample_rate)
    x = _as_float_audio(audio)
    n = -(-x.numel() // SAMPLES_PER_FRAME)
    x = F.pad(x, (0, n * SAMPLES_PER_FRAME - x.numel()))
    return x.view(n, SAMPLES_PER_FRAME).square().mean(dim=1).sqrt().numpy()


class AudioEncoder(nn.Module):
    """Timeline windows -> audio tokens. See the module docstring for the window contract."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        if TIMELINE_RATE % cfg.audio_rate or cfg.audio_rate % 100:
            raise ValueError(
                f"preset {cfg.name!r}: audio_rate {cfg.audio_rate} Hz must divide {TIMELINE_RATE} Hz "
                "(integer decimation) and be a multiple of 100 Hz (10 ms hop)"
            )
        self.cfg = cfg
        self.factor = TIMELINE_RATE // cfg.audio_rate
        self.context_samples = round(cfg.audio_context_ms * TIMELINE_RATE / 1000)
        self.lookahead_samples = round(cfg.audio_lookahead_ms * TIMELINE_RATE / 1000)
        self.window_samples = self.context_samples + SAMPLES_PER_CHUNK + self.lookahead_samples
        self.n_fft = round(cfg.audio_rate * WINDOW_MS / 1000)
        self.hop = round(cfg.audio_rate * HOP_MS / 1000)
        taps = lowpass_taps(self.factor)
        self.half = (taps.numel() - 1) // 2
        # First kept output sample whose taps start at the window's first sample; then as many
        # whole STFT frames as fit with all their taps inside the window.
        self.first = self.half // self.factor
        last = (self.window_samples - 1 - self.half) // self.factor  # last fully supported output
        self.n_frames = (last - self.first + 1 - self.n_fft) // self.hop + 1
        if self.n_frames < 1:
            raise ValueError(f"preset {cfg.name!r}: audio window of {self.window_samples} samples holds no mel frame")
        self.segment = (self.n_frames - 1) * self.hop + self.n_fft  # output samples the frames use
        self.register_buffer("taps", taps.view(1, 1, -1), persistent=False)
        self.register_buffer("stft_window", torch.hann_window(self.n_fft), persistent=False)
        self.register_buffer("mel_fb", mel_filterbank(self.n_fft, cfg.audio_rate), persistent=False)

        d = cfg.audio_dim
        heads = max(1, d // 64)
        self.conv1 = nn.Conv1d(N_MELS, d, 3, padding=1)
        self.conv2 = nn.Conv1d(d, d, 3, padding=1)
        self.pos = nn.Parameter(torch.randn(self.n_frames, d) * 0.02)
        layer = nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, activation="gelu",
                                           batch_first=True, norm_first=True)
        self.layers = nn.TransformerEncoder(layer, cfg.audio_layers, enable_nested_tensor=False)
        self.queries = nn.Parameter(torch.randn(cfg.n_audio_tokens, d) * 0.02)
        self.pool = nn.MultiheadAttention(d, heads, batch_first=True)
        self.norm_out = nn.LayerNorm(d)
        self.proj_out = nn.Linear(d, d)

    # --- front end: always fp32 (also in a bf16 module), no parameters ---------------------------

    def _log_mel(self, segments: Tensor) -> Tensor:
        """(B, segment) samples at audio_rate -> (B, n_frames, N_MELS) normalised log-mel."""
        spec = torch.stft(segments, self.n_fft, self.hop, window=self.stft_window.float(), center=False,
                          return_complex=True)
        mel = self.mel_fb.float() @ spec.abs().square()  # (B, N_MELS, n_frames)
        return ((torch.log(mel + 1e-6) + 5.0) / 4.0).transpose(1, 2)

    def resample(self, audio: Tensor) -> Tensor:
        """(B, L) float at 48 kHz -> (B, n) at audio_rate: output j is the low-passed input at j*factor + half.

        Only the kept outputs are computed (a strided conv: the polyphase form of decimation), and
        only outputs whose taps lie inside the input are produced.
        """
        return F.conv1d(audio[:, None], self.taps.float(), stride=self.factor)[:, 0]

    def window_features(self, windows: Tensor) -> Tensor:
        """(B, window_samples) float timeline windows -> (B, n_frames, N_MELS)."""
        return self._log_mel(self.resample(windows)[:, : self.segment])

    def clip_features(self, audio: Tensor) -> Tensor:
        """Whole clip (L,) float -> (n_chunks, n_frames, N_MELS): filter once, gather each chunk's samples."""
        n_chunks = max(1, -(-audio.numel() // SAMPLES_PER_CHUNK))
        tail = n_chunks * SAMPLES_PER_CHUNK - audio.numel() + self.lookahead_samples
        padded = F.pad(audio, (self.context_samples, tail))  # padded[p] = timeline[p - context]
        y = F.conv1d(padded[None, None], self.taps.float())[0, 0]  # y[p] = low-passed padded[p + half], every sample
        starts = torch.arange(n_chunks, device=audio.device)[:, None] * SAMPLES_PER_CHUNK
        index = starts + self.factor * torch.arange(self.segment, device=audio.device)[None]
        return self._log_mel(y[index])

    # --- network ---------------------------------------------------------------------------------

    def forward(self, features: Tensor) -> Tensor:
        """(B, n_frames, N_MELS) log-mel -> (B, n_audio_tokens, audio_dim)."""
        x = features.to(self.pos.dtype).transpose(1, 2)
        x = F.gelu(self.conv2(F.gelu(self.conv1(x)))).transpose(1, 2) + self.pos
        x = self.layers(x)
        q = self.queries.expand(x.shape[0], -1, -1)
        pooled, _ = self.pool(q, x, x, need_weights=False)
        return self.proj_out(self.norm_out(pooled))

    def encode_window(self, window: np.ndarray | Tensor, sample_rate: int = TIMELINE_RATE) -> Tensor:
        """One chunk's timeline window (window_samples,) or a batch (B, window_samples) -> tokens."""
        _check_rate(sample_rate)
        x = _as_float_audio(window).to(self.taps.device)
        single = x.dim() == 1
        x = x[None] if single else x
        if x.dim() != 2 or x.shape[1] != self.window_samples:
            raise ValueError(
                f"audio window must hold {self.window_samples} samples at {TIMELINE_RATE} Hz "
                f"({self.context_samples} context + {SAMPLES_PER_CHUNK} chunk + {self.lookahead_samples} "
                f"look-ahead), got shape {tuple(x.shape if not single else x.shape[1:])}"
            )
        tokens = self(self.window_features(x))
        return tokens[0] if single else tokens

    def encode_clip(self, audio: np.ndarray | Tensor, sample_rate: int = TIMELINE_RATE) -> Tensor:
        """Whole clip of timeline audio from sample 0 -> tokens of every chunk (n_chunks, n_tokens, dim)."""
        _check_rate(sample_rate)
        x = _as_float_audio(audio).to(self.taps.device)
        if x.dim() != 1:
            raise ValueError(f"clip audio must be mono (L,), got shape {tuple(x.shape)}")
        return self(self.clip_features(x))

    def window_bounds(self, chunk: int) -> tuple[int, int]:
        """Timeline samples [start, end) of chunk ``chunk``'s window (start may be negative: zeros)."""
        start = chunk * SAMPLES_PER_CHUNK - self.context_samples
        return start, start + self.window_samples


def make_encode_fn(encoder: AudioEncoder) -> Callable[[np.ndarray], np.ndarray]:
    """The conditioning stage's callable: int16 window -> float32 (n_audio_tokens, audio_dim)."""
    def encode(window: np.ndarray) -> np.ndarray:
        with torch.inference_mode():
            return encoder.encode_window(window).float().cpu().numpy()

    return encode
