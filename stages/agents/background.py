"""Suppression of a steady background (white noise, hiss, a fan) in the recogniser's features.

Contract: ``suppress_background(power, mel, signal_frames)`` takes a power spectrogram (bins x
frames, ``mel``'s bins), of which the first ``signal_frames`` frames are the utterance (the rest is
padding), and returns its mel power (``mel``'s bands x frames). The background's spectrum is the mean
of the utterance's quietest ``QUIET_FRACTION`` of frames (an utterance the recogniser hears starts
with ~0.25 s before the speech and ends with its tail: those frames are the background). Each mel
band's power is reduced by the background's power in that band, but to no less than ``FLOOR_DB``
below what it was. When the background is quieter than ``LOUD_DBFS``, or the utterance too short to
estimate it, the mel power is returned unchanged, so speech in a quiet room is untouched.

    mel_power = suppress_background(power, mel_filters(), frames_of_audio)
"""

from __future__ import annotations

import math

import torch

QUIET_FRACTION = 0.1  # the quietest frames, at least MIN_QUIET_FRAMES, are taken as the background
MIN_QUIET_FRAMES = 10  # 0.1 s at 10 ms a frame: fewer would not average out a noise's fluctuation
# Above this the background is loud: speech through Opus in a quiet room measures ~-110 dBFS, white
# noise 20 dB under espeak's speech ~-48 dBFS.
LOUD_DBFS = -50.0
# A band is lowered at most this much. Whisper reads a band pushed towards the features' floor as
# meaningful (a band-pass that zeroed bands: 44.8% WER at 10 dB); on the development set a 15 dB floor
# gave 29.4% where 10 dB gave 22.1% (docs/decisions/0022).
FLOOR_DB = 10.0


def background_dbfs(noise_power: torch.Tensor, window: torch.Tensor) -> float:
    """The level (dBFS, float samples) of a background whose one-sided power spectrum per frame is
    ``noise_power`` (bins,), from an FFT over ``window`` (bins = n_fft // 2 + 1)."""
    n_fft = 2 * (noise_power.shape[0] - 1)
    per_sample = 2.0 * float(noise_power.sum()) / (n_fft * float((window ** 2).sum()))
    return 10.0 * math.log10(per_sample + 1e-20)


def suppress_background(power: torch.Tensor, mel: torch.Tensor, signal_frames: int,
                        window: torch.Tensor | None = None) -> torch.Tensor:
    """``mel @ power`` with a loud steady background subtracted per band (see the module's contract).
    ``window``: the STFT's window, for the background's level (default: a Hann window of the
    spectrum's FFT size)."""
    if power.dim() != 2 or mel.dim() != 2 or power.shape[0] != mel.shape[1]:
        raise ValueError(f"power spectrogram {tuple(power.shape)} does not fit mel filters {tuple(mel.shape)}: "
                         "expected (bins, frames) and (bands, bins)")
    if not 0 <= signal_frames <= power.shape[1]:
        raise ValueError(f"signal_frames {signal_frames} outside the spectrogram's {power.shape[1]} frames")
    mel_power = mel @ power
    if signal_frames < MIN_QUIET_FRAMES:
        return mel_power
    energy = power[:, :signal_frames].sum(0)
    quiet = torch.topk(energy, max(MIN_QUIET_FRAMES, int(QUIET_FRACTION * signal_frames)), largest=False).indices
    noise = power[:, quiet].mean(1, keepdim=True)
    if window is None:
        window = torch.hann_window(2 * (power.shape[0] - 1))
    if background_dbfs(noise[:, 0], window) < LOUD_DBFS:
        return mel_power
    # in mel bands rather than FFT bins: a band averages its bins' random fluctuation, so the gain does
    # not flicker from bin to bin (per bin, the development set's female voice lost 4-14 points)
    gain = torch.clamp(1.0 - (mel @ noise) / torch.clamp(mel_power, min=1e-20), min=10.0 ** (-FLOOR_DB / 10.0))
    return mel_power * gain
