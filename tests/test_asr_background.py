"""The recogniser's background suppression: it lowers a loud steady noise, keeps the speech-like part,
never lowers a band more than its floor, leaves a quiet recording untouched, and refuses a
spectrogram that does not fit the mel filters."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from charstream.stages.agents.background import (
    FLOOR_DB,
    MIN_QUIET_FRAMES,
    background_dbfs,
    suppress_background,
)
from charstream.stages.agents.log_mel import HOP, N_FFT, SAMPLE_RATE, log_mel, mel_filters

WINDOW = torch.hann_window(N_FFT)
TONE_HZ = 1_000.0


def power_of(audio: np.ndarray) -> torch.Tensor:
    spectrum = torch.stft(torch.from_numpy(audio), N_FFT, HOP, window=WINDOW, center=True, return_complex=True)
    return spectrum[:, :-1].abs() ** 2


def noisy_tone(noise_rms: float, seed: int = 0) -> tuple[np.ndarray, int]:
    """0.5 s of white noise alone, then 2 s of a 1 kHz tone (0.1 rms) in the same noise; the frame
    where the tone starts."""
    t = np.arange(int(2.5 * SAMPLE_RATE)) / SAMPLE_RATE
    tone = np.where(t >= 0.5, 0.1 * np.sqrt(2) * np.sin(2 * np.pi * TONE_HZ * t), 0.0)
    noise = np.random.default_rng(seed).standard_normal(len(t)) * noise_rms
    return (tone + noise).astype(np.float32), int(0.5 * SAMPLE_RATE) // HOP


def tone_band() -> int:
    return int(torch.argmax(mel_filters()[:, round(TONE_HZ / (SAMPLE_RATE / N_FFT))]))


def test_the_background_level_is_measured_in_dbfs():
    noise = np.random.default_rng(1).standard_normal(SAMPLE_RATE * 3).astype(np.float32) * 0.01  # -40 dBFS
    assert background_dbfs(power_of(noise).mean(1), WINDOW) == pytest.approx(-40.0, abs=0.3)


def test_a_loud_background_is_lowered_and_the_tone_kept():
    audio, onset = noisy_tone(noise_rms=0.03)  # -30 dBFS, 10 dB under the tone
    power = power_of(audio)
    plain = mel_filters() @ power
    cleaned = suppress_background(power, mel_filters(), power.shape[1], WINDOW)
    noise_only = slice(5, onset - 5)
    lowered_db = 10 * torch.log10(plain[:, noise_only] / cleaned[:, noise_only])
    assert float(lowered_db.median()) > 0.9 * FLOOR_DB  # most of the noise went down by the floor's depth
    assert float(lowered_db.mean()) > 0.6 * FLOOR_DB
    band, tone = tone_band(), slice(onset + 5, power.shape[1] - 5)
    kept_db = 10 * torch.log10(plain[band, tone].mean() / cleaned[band, tone].mean())
    assert 0.0 <= kept_db < 1.0  # the tone's band loses less than 1 dB (the noise's share of it)
    ratio = cleaned / torch.clamp(plain, min=1e-20)
    assert float(ratio.min()) >= 10 ** (-FLOOR_DB / 10) * (1 - 1e-5)  # never below the floor
    assert float(ratio.max()) <= 1.0


def test_a_quiet_background_is_left_as_it_is():
    audio, _ = noisy_tone(noise_rms=0.0003)  # -70 dBFS
    power = power_of(audio)
    assert torch.equal(suppress_background(power, mel_filters(), power.shape[1], WINDOW), mel_filters() @ power)
    padded = np.concatenate([audio, np.zeros(SAMPLE_RATE, np.float32)])
    assert np.array_equal(log_mel(padded, len(audio) // HOP), log_mel(padded))


def test_the_background_is_estimated_over_the_utterance_not_its_padding():
    audio, _ = noisy_tone(noise_rms=0.03)
    padded = np.concatenate([audio, np.zeros(6 * SAMPLE_RATE, np.float32)])
    frames = len(audio) // HOP
    # over all frames the quietest are the padding's silence: nothing loud to remove
    assert np.array_equal(log_mel(padded, len(padded) // HOP), log_mel(padded))
    lowered = log_mel(padded, frames)[:, 5:40].mean()
    assert lowered < log_mel(padded)[:, 5:40].mean() - 0.15  # over 0.6 decades less noise


def test_too_short_an_utterance_is_left_as_it_is():
    audio, _ = noisy_tone(noise_rms=0.03)
    power = power_of(audio)
    short = suppress_background(power, mel_filters(), MIN_QUIET_FRAMES - 1, WINDOW)
    assert torch.equal(short, mel_filters() @ power)


def test_a_spectrogram_that_does_not_fit_is_refused():
    power = power_of(noisy_tone(noise_rms=0.03)[0])
    with pytest.raises(ValueError, match="does not fit mel filters"):
        suppress_background(power[:-1], mel_filters(), power.shape[1])
    with pytest.raises(ValueError, match="does not fit mel filters"):
        suppress_background(power[:, 0], mel_filters(), 1)
    with pytest.raises(ValueError, match="outside the spectrogram"):
        suppress_background(power, mel_filters(), power.shape[1] + 1)
    with pytest.raises(ValueError, match="outside the spectrogram"):
        suppress_background(power, mel_filters(), -1)
