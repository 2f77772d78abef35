import subprocess
import sys
import time

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


def test_a_breathy_voice_sounds_the_same_in_every_run():
    """en+f3's breath noise is random inside espeak, seeded from the clock's second: two processes a second
    apart must still make the same audio of the same utterances (a benchmark's speech, a demo's replies)."""
    code = ("import hashlib; from charstream.stages.agents.tts import synthesize; "
            "print([hashlib.sha256(synthesize(t, 'en+f3').samples.tobytes()).hexdigest() "
            "for t in ('My cousin is flying to Denver tomorrow.', 'The same words.')])")
    runs = []
    for _ in range(2):
        runs.append(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
        time.sleep(1.1)
    assert runs[0] == runs[1] and len(runs[0]) > 100
