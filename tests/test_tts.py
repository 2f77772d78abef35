import numpy as np

from charstream.stages.agents.tts import synthesize


def test_espeak_speaks_with_phoneme_timing():
    speech = synthesize("Hello there, how can I help you today?", "en+f3")
    assert speech.sample_rate == 22050
    assert 1.0 < speech.duration < 5.0
    assert np.abs(speech.samples.astype(np.int32)).max() > 1000  # real signal, not silence
    times = [t for t, _ in speech.phonemes]
    assert len(times) > 10 and times == sorted(times) and times[-1] < speech.duration


def test_two_voices_differ():
    a = synthesize("The same words.", "en-us")
    b = synthesize("The same words.", "en+f3")
    n = min(len(a.samples), len(b.samples))
    assert not np.array_equal(a.samples[:n], b.samples[:n])
