"""The model families behind the serving interface: the characters presets as a family, and FlashHead's
audio conditioner reading the conditioning stage's 48 kHz windows."""

import numpy as np
import pytest

from charstream.model.families import FAMILY_NAMES, get_family
from charstream.model.families.flashhead.config import TEST
from charstream.model.weights import packaged_weights
from charstream.timeline import CHARACTERS, TIMELINE_RATE


def test_presets_are_the_characters_family():
    assert "tiny" in FAMILY_NAMES and "flashhead-pro" in FAMILY_NAMES
    tiny = get_family("tiny")
    assert tiny.timeline is CHARACTERS and tiny.generation_mode == "kv_ring"
    weights = packaged_weights("tiny")
    report = tiny.inspect(weights)
    assert report.ok and report.params == tiny.parameter_count() > 0
    assert report.ignored  # the VAE and audio encoder stored beside the DiT
    with pytest.raises(ValueError, match="unknown model preset 'nano'"):
        get_family("nano")


def test_characters_conditioner_is_the_presets_audio_encoder():
    conditioner = get_family("tiny").audio_conditioner("packaged", seed=0)
    cfg = get_family("tiny").config
    assert (conditioner.context_ms, conditioner.lookahead_ms) == (cfg.audio_context_ms, cfg.audio_lookahead_ms)
    span = round((conditioner.context_ms + conditioner.lookahead_ms) * TIMELINE_RATE / 1000) + CHARACTERS.samples_per_chunk
    tokens = conditioner.encode(np.zeros(span, np.int16))
    assert tokens.shape == (cfg.n_audio_tokens, cfg.audio_dim)


def speech_like(seconds: float, seed: int) -> np.ndarray:
    """A voiced, syllable-modulated signal at 48 kHz (int16): enough to move wav2vec2's features."""
    rng = np.random.default_rng(seed)
    t = np.arange(int(seconds * TIMELINE_RATE)) / TIMELINE_RATE
    pitch = 120 + 30 * np.sin(2 * np.pi * 0.7 * t)
    voiced = sum(np.sin(2 * np.pi * k * np.cumsum(pitch) / TIMELINE_RATE) / k for k in range(1, 8))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 4 * t + rng.uniform(0, 6))
    return (8000 * voiced * envelope + rng.normal(0, 200, t.size)).astype(np.int16)


def test_flashhead_conditioner_tokens_from_a_timeline_window():
    family = get_family("flashhead-pro", config=TEST)
    assert family.timeline.fps == 25 and family.timeline.frames_per_chunk == 28
    conditioner = family.audio_conditioner("random", seed=3)
    # the window is the 8 s rolling context ending at the chunk's end
    assert conditioner.context_ms == pytest.approx(8000 - 1120) and conditioner.lookahead_ms == 0
    span = TEST.audio_context_s * TIMELINE_RATE
    silence = conditioner.encode(np.zeros(span, np.int16))
    window = np.zeros(span, np.int16)
    window[-family.timeline.samples_per_chunk:] = speech_like(1.12, seed=1)  # speech in the chunk's span only
    speech = conditioner.encode(window)
    assert speech.shape == (TEST.latents_per_chunk, TEST.audio_tokens, TEST.dim) and speech.dtype == np.float32
    assert np.isfinite(speech).all()
    moved = np.abs(speech - silence).mean(axis=(1, 2))
    assert (moved > 1e-3 * np.abs(silence).mean()).all(), moved  # every latent frame hears the chunk's speech
    np.testing.assert_array_equal(conditioner.encode(window), speech)  # a function of its window
    with pytest.raises(ValueError, match="384000 samples"):
        conditioner.encode(np.zeros(span - 1, np.int16))
