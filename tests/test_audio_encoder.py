"""Audio encoder: streaming == whole clip, resampler quality, the window contract, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from charstream.model.audio_encoder import AudioEncoder, make_encode_fn, rms_envelope
from charstream.model.config import CHARACTERS_57B, TINY
from charstream.timeline import CHARACTERS, TIMELINE_RATE

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def encoder() -> AudioEncoder:
    torch.manual_seed(0)
    return AudioEncoder(TINY).eval()


def _speechlike(n: int, seed: int) -> np.ndarray:
    """Random bursts of noisy harmonics with pauses: content that differs chunk to chunk."""
    rng = np.random.default_rng(seed)
    t = np.arange(n) / TIMELINE_RATE
    f0 = 120 + 80 * np.sin(2 * np.pi * rng.uniform(0.5, 2) * t)
    x = sum(np.sin(2 * np.pi * k * np.cumsum(f0) / TIMELINE_RATE) / k for k in range(1, 8))
    gate = np.repeat(rng.uniform(size=n // 4000 + 1) > 0.3, 4000)[:n]
    x = (x * gate + 0.05 * rng.standard_normal(n)) * 6000
    return np.clip(x, -32768, 32767).astype(np.int16)


def test_streaming_windows_equal_whole_clip(encoder: AudioEncoder) -> None:
    audio = _speechlike(6 * CHARACTERS.samples_per_chunk + 3_217, seed=1)
    with torch.inference_mode():
        whole = encoder.encode_clip(audio)
    assert whole.shape == (7, TINY.n_audio_tokens, TINY.audio_dim)

    # Stream the audio in irregular pieces into a timeline buffer; encode each chunk as soon as its
    # window (context + span + look-ahead) is complete, zeros before 0 and after the end.
    rng = np.random.default_rng(2)
    timeline = np.zeros(0, np.int16)
    pos, chunk, tokens = 0, 0, []
    while chunk < whole.shape[0]:
        if pos < len(audio):
            step = int(rng.integers(500, 5_000))
            timeline = np.concatenate([timeline, audio[pos : pos + step]])
            pos += step
        start, end = encoder.window_bounds(chunk)
        if end > len(timeline) and pos < len(audio):
            continue
        window = np.zeros(end - start, np.int16)
        lo, hi = max(start, 0), min(end, len(timeline))
        window[lo - start : hi - start] = timeline[lo:hi]
        with torch.inference_mode():
            tokens.append(encoder.encode_window(window))
        chunk += 1
    streamed = torch.stack(tokens)
    rel = ((streamed - whole).norm(dim=(1, 2)) / whole.norm(dim=(1, 2))).max().item()
    assert rel < 1e-4, rel
    # different chunks really got different tokens (the check above is not vacuous)
    assert (whole[1] - whole[2]).norm() > 0.1 * whole[1].norm()


def test_tokens_depend_on_look_ahead_and_context_only_within_the_window(encoder: AudioEncoder) -> None:
    window = _speechlike(encoder.window_samples, seed=3)
    with torch.inference_mode():
        base = encoder.encode_window(window)
        for region in (slice(0, encoder.context_samples),  # left context
                       slice(encoder.window_samples - encoder.lookahead_samples, None)):  # look-ahead
            changed = window.copy()
            changed[region] = 0
            assert (encoder.encode_window(changed) - base).norm() > 1e-3 * base.norm()


def test_resampler_keeps_a_1khz_tone_and_removes_10khz(encoder: AudioEncoder) -> None:
    t = torch.arange(TIMELINE_RATE, dtype=torch.float64) / TIMELINE_RATE
    for freq, expect_amplitude in ((1_000.0, 1.0), (10_000.0, 0.0)):
        x = (0.5 * torch.sin(2 * torch.pi * freq * t)).float()[None]
        y = encoder.resample(x)[0, 100:-100].double()  # away from the ends of the test tone
        spectrum = torch.fft.rfft(y * torch.hann_window(len(y), dtype=torch.float64))
        peak_hz = spectrum.abs().argmax().item() * TINY.audio_rate / len(y)
        amplitude = (2 * y.square().mean()).sqrt().item() / 0.5
        if expect_amplitude:
            assert abs(peak_hz - freq) < 2.0, peak_hz
            assert abs(amplitude - 1.0) < 0.01, amplitude
        else:  # 10 kHz is above the 8 kHz Nyquist: it must not alias into the band (>= 60 dB down)
            assert amplitude < 1e-3, amplitude
    n = TIMELINE_RATE // (TIMELINE_RATE // TINY.audio_rate)
    assert abs(encoder.resample(torch.zeros(1, TIMELINE_RATE)).shape[1] - n) <= 2 * encoder.half // encoder.factor


def test_wrong_rate_and_bad_windows_fail_clearly(encoder: AudioEncoder) -> None:
    window = np.zeros(encoder.window_samples, np.int16)
    with pytest.raises(ValueError, match="48000 Hz timeline audio, got 22050 Hz"):
        encoder.encode_window(window, sample_rate=22_050)
    with pytest.raises(ValueError, match="48000 Hz timeline audio, got 16000 Hz"):
        encoder.encode_clip(window, sample_rate=16_000)
    with pytest.raises(ValueError, match=f"must hold {encoder.window_samples} samples"):
        encoder.encode_window(window[:CHARACTERS.samples_per_chunk])
    with pytest.raises(ValueError, match="int16 or float"):
        encoder.encode_window(window.astype(np.int32))
    with pytest.raises(ValueError, match="audio_rate 22050 Hz must divide 48000"):
        AudioEncoder(TINY.with_(audio_rate=22_050))


def test_encode_fn_and_shapes_for_both_presets(encoder: AudioEncoder) -> None:
    tokens = make_encode_fn(encoder)(np.zeros(encoder.window_samples, np.int16))
    assert tokens.dtype == np.float32 and tokens.shape == (TINY.n_audio_tokens, TINY.audio_dim)
    assert np.isfinite(tokens).all()
    with torch.device("meta"):  # the full-size encoder, without allocating it
        big = AudioEncoder(CHARACTERS_57B)
        out = big.encode_window(torch.zeros(big.window_samples))
    assert out.shape == (CHARACTERS_57B.n_audio_tokens, CHARACTERS_57B.audio_dim)


def test_bf16_encoder_keeps_an_fp32_front_end(encoder: AudioEncoder) -> None:
    window = _speechlike(encoder.window_samples, seed=4)
    low = AudioEncoder(TINY).eval()
    low.load_state_dict(encoder.state_dict())
    low = low.to(torch.bfloat16)
    with torch.inference_mode():
        ref, tokens = encoder.encode_window(window), low.encode_window(window)
    assert tokens.dtype == torch.bfloat16
    assert ((tokens.float() - ref).norm() / ref.norm()).item() < 0.05


def test_rms_envelope_per_video_frame() -> None:
    t = np.arange(3 * CHARACTERS.samples_per_frame + 500) / TIMELINE_RATE
    audio = (0.25 * 32768 * np.sin(2 * np.pi * 480 * t)).astype(np.int16)
    audio[CHARACTERS.samples_per_frame : 2 * CHARACTERS.samples_per_frame] = 0
    env = rms_envelope(audio)
    assert env.shape == (4,) and env.dtype == np.float32
    np.testing.assert_allclose(env[[0, 2]], 0.25 / np.sqrt(2), rtol=1e-3)
    assert env[1] == 0.0
    with pytest.raises(ValueError, match="48000 Hz"):
        rms_envelope(audio, sample_rate=16_000)
