"""The streaming polyphase resampler: accuracy, aliasing, exact sample counts, chunking invariance."""

import numpy as np
import pytest

from charstream.stages.ingest.resample import StreamingResampler, resample, to_int16


@pytest.mark.parametrize("rate", [8_000, 16_000, 22_050, 24_000, 44_100])
def test_sine_upsampled_to_the_timeline_is_accurate(rate):
    n = rate  # one second
    x = (0.5 * np.sin(2 * np.pi * 1_000 * np.arange(n) / rate)).astype(np.float32)
    y = resample(x, rate, 48_000)
    assert len(y) == 48_000
    ref = 0.5 * np.sin(2 * np.pi * 1_000 * np.arange(len(y)) / 48_000)
    inner = slice(2_000, -2_000)  # away from the silence assumed before and after the signal
    err = y[inner] - ref[inner]
    snr_db = 10 * np.log10(np.mean(ref[inner] ** 2) / np.mean(err ** 2))
    assert snr_db > 80, snr_db


def test_downsampling_rejects_what_the_lower_rate_cannot_hold():
    x = np.sin(2 * np.pi * 10_000 * np.arange(48_000) / 48_000).astype(np.float32)  # above 8 kHz Nyquist
    y = resample(x, 48_000, 16_000)
    assert np.sqrt(np.mean(y[500:-500] ** 2)) < 1e-3  # < -57 dB re. the input's 0.707 rms


@pytest.mark.parametrize("rate_in,rate_out", [(22_050, 48_000), (48_000, 16_000), (44_100, 48_000)])
def test_streaming_in_any_chunks_equals_one_shot(rate_in, rate_out):
    rng = np.random.default_rng(1)
    x = rng.uniform(-0.5, 0.5, rate_in // 2).astype(np.float32)
    one_shot = resample(x, rate_in, rate_out)
    r = StreamingResampler(rate_in, rate_out)
    parts, i = [], 0
    while i < len(x):
        size = int(rng.integers(1, 1_500))
        parts.append(r.push(x[i:i + size]))
        i += size
    parts.append(r.flush())
    streamed = np.concatenate(parts)
    assert len(streamed) == -(-len(x) * rate_out // rate_in)
    np.testing.assert_allclose(streamed, one_shot, atol=1e-5)


def test_to_int16_saturates_instead_of_wrapping():
    out = to_int16(np.array([1.2, -1.2, 0.5], np.float32))
    assert out.tolist() == [32767, -32768, 16384]


def test_refuses_nonsense_rates():
    with pytest.raises(ValueError):
        StreamingResampler(0, 48_000)
    with pytest.raises(ValueError, match="filter phases"):
        StreamingResampler(44_101, 48_000)


@pytest.mark.parametrize("rate_in,rate_out", [(48_000, 16_000), (22_050, 48_000)])
def test_each_output_is_the_windowed_sinc_sum_around_its_input_time(rate_in, rate_out):
    # the oracle, one output at a time: sample k sits at input time k·down/up, taps of its phase
    rng = np.random.default_rng(2)
    x = rng.uniform(-0.5, 0.5, 2_000).astype(np.float32)
    r = StreamingResampler(rate_in, rate_out)
    taps, half = r._taps, r._half
    padded = np.concatenate([np.zeros(half, np.float32), x, np.zeros(half, np.float32)])
    y = np.concatenate([r.push(x[:700]), r.push(x[700:]), r.flush()])
    expected = [float(np.dot(padded[(k * r.down) // r.up + 1:(k * r.down) // r.up + 1 + 2 * half],
                             taps[(k * r.down) % r.up].astype(np.float64))) for k in range(len(y))]
    np.testing.assert_allclose(y, expected, atol=1e-5)
