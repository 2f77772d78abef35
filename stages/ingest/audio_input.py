"""Checks and normalises agent audio before it reaches the timeline: rate, sample format, channels,
non-finite and out-of-range samples.

Agents are other people's code: a wrong rate or dtype is refused with an error that says what was
expected; NaN/inf samples become silence and out-of-range floats are clipped (the stream goes on, the
caller logs how many samples were repaired, with the turn id).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Rates a TTS or a WebRTC track actually produces; each converts to 48 kHz with ≤ 320 filter phases.
SUPPORTED_RATES = (8_000, 11_025, 12_000, 16_000, 22_050, 24_000, 32_000, 44_100, 48_000, 96_000)
SUPPORTED_DTYPES = ("int16", "float32")
MAX_CHANNELS = 2


class AudioFormatError(ValueError):
    """Agent audio in a format ingest cannot take (the message says what it got and what it accepts)."""


@dataclass
class Repairs:
    non_finite: int = 0  # NaN/inf samples replaced by silence
    clipped: int = 0  # float samples outside [-1, 1] clipped
    saturated: int = 0  # int16 samples at full scale (already clipped by the agent); counted, kept

    def __bool__(self) -> bool:
        return bool(self.non_finite or self.clipped)


def check_format(sample_rate: int, dtype: str, channels: int) -> None:
    """Raises AudioFormatError unless ingest can take audio of this rate, dtype and channel count."""
    if sample_rate not in SUPPORTED_RATES:
        raise AudioFormatError(f"unsupported sample rate {sample_rate} Hz; supported: {list(SUPPORTED_RATES)}")
    if dtype not in SUPPORTED_DTYPES:
        raise AudioFormatError(f"unsupported sample format {dtype!r}; supported: {list(SUPPORTED_DTYPES)}")
    if not 1 <= channels <= MAX_CHANNELS:
        raise AudioFormatError(f"unsupported channel count {channels}; supported: 1..{MAX_CHANNELS} (interleaved)")


def to_float_mono(samples: np.ndarray, sample_rate: int, channels: int = 1) -> tuple[np.ndarray, Repairs]:
    """Validated float32 mono samples in [-1, 1]; interleaved multi-channel input is averaged."""
    samples = np.asarray(samples)
    check_format(sample_rate, samples.dtype.name, channels)
    if samples.ndim != 1:
        raise AudioFormatError(f"expected a 1-D (interleaved) sample array, got shape {samples.shape}")
    if len(samples) % channels:
        raise AudioFormatError(f"{len(samples)} samples is not a whole number of {channels}-channel frames")
    repairs = Repairs()
    if samples.dtype == np.int16:
        repairs.saturated = int(np.count_nonzero((samples == 32767) | (samples == -32768)))
        audio = samples.astype(np.float32) / 32768.0
    else:
        audio = samples.astype(np.float32, copy=True)
        bad = ~np.isfinite(audio)
        repairs.non_finite = int(np.count_nonzero(bad))
        if repairs.non_finite:
            audio[bad] = 0.0
        over = np.abs(audio) > 1.0
        repairs.clipped = int(np.count_nonzero(over))
        if repairs.clipped:
            np.clip(audio, -1.0, 1.0, out=audio)
    if channels > 1:
        audio = audio.reshape(-1, channels).mean(axis=1)
    return audio, repairs
