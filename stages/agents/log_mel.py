"""Whisper's input features: an 80-band log-mel spectrogram of 16 kHz audio, 10 ms a frame.

Whisper was trained on spectrograms of 25 ms Hann windows (400-point FFT) every 10 ms, mapped to 80
Slaney-scale mel bands up to 8 kHz, log10 of the power, floored 8 decades below the loudest band and
scaled to about [-1, 1]. This computes the same features over only the audio given (no padding to
30 s: the recogniser encodes just the utterance).

    features = log_mel(audio_16k_float32)     # (80, len(audio) // 160) float32
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from charstream.stages.agents.background import suppress_background

SAMPLE_RATE = 16_000
N_FFT = 400
HOP = 160
N_MELS = 80


def _hz_to_mel(hz: np.ndarray) -> np.ndarray:
    """Slaney's mel scale: linear below 1 kHz, logarithmic above."""
    hz = np.asarray(hz, np.float64)
    linear = hz / (200.0 / 3)
    log_step = np.log(6.4) / 27.0
    return np.where(hz >= 1000.0, 15.0 + np.log(np.maximum(hz, 1e-9) / 1000.0) / log_step, linear)


def _mel_to_hz(mel: np.ndarray) -> np.ndarray:
    log_step = np.log(6.4) / 27.0
    return np.where(mel >= 15.0, 1000.0 * np.exp(log_step * (mel - 15.0)), mel * (200.0 / 3))


@functools.cache
def mel_filters() -> torch.Tensor:
    """(N_MELS, N_FFT // 2 + 1) triangular filters, each normalised to unit area (Slaney)."""
    fft_hz = np.linspace(0, SAMPLE_RATE / 2, N_FFT // 2 + 1)
    edges = _mel_to_hz(np.linspace(_hz_to_mel(0.0), _hz_to_mel(SAMPLE_RATE / 2), N_MELS + 2))
    widths = np.diff(edges)
    rising = (fft_hz[None, :] - edges[:-2, None]) / widths[:-1, None]
    falling = (edges[2:, None] - fft_hz[None, :]) / widths[1:, None]
    filters = np.maximum(0.0, np.minimum(rising, falling))
    filters *= (2.0 / (edges[2:] - edges[:-2]))[:, None]
    return torch.from_numpy(filters.astype(np.float32))


@functools.cache
def _window() -> torch.Tensor:
    return torch.hann_window(N_FFT)


def log_mel(audio: np.ndarray, background_frames: int = 0) -> np.ndarray:
    """(N_MELS, frames) float32 features of mono float32 16 kHz ``audio``. With ``background_frames``,
    the first that many frames are the utterance (the rest padding), and a loud steady background
    estimated over them is suppressed (``background.suppress_background``)."""
    spectrum = torch.stft(torch.from_numpy(np.ascontiguousarray(audio, np.float32)), N_FFT, HOP,
                          window=_window(), center=True, pad_mode="reflect", return_complex=True)
    power = spectrum[:, :-1].abs() ** 2  # the last frame only covers the reflected padding
    mel_power = suppress_background(power, mel_filters(), min(background_frames, power.shape[1]), _window())
    log_power = torch.clamp(mel_power, min=1e-10).log10()
    log_power = torch.maximum(log_power, log_power.max() - 8.0)
    return ((log_power + 4.0) / 4.0).numpy()
