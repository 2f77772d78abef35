"""Streaming for an encoder-decoder recogniser (Moonshine, Whisper): the audio is decoded while the
user speaks, so little is left after the end of speech.

``feed`` only stores the audio; a worker thread per utterance decodes it: a partial transcript of the
audio so far every ``PARTIAL_EVERY_S``; the tokens two consecutive partials agree on are stable, and
later decodes are forced to start with them. When the audio has been quiet ``PAUSE_S`` after its last
loud sample, the transcript up to there is made at once: the VAD ends the turn only after 300 ms of
quiet, so by then it is usually ready, and ``end()`` only decodes again if speech came after that
pause.

    recogniser = MoonshineRecognizer(sample_rate=48_000)      # a StreamingRecognizer
    recogniser.begin(); recogniser.feed(samples); transcript = recogniser.end()

Same interface as ``stages.agents.asr.SpeechRecognizer``: ``begin``/``feed``/``end`` from one thread
at a time (``TurnRecognizer`` serialises them). A model subclasses ``StreamingRecognizer`` with its
``_decode`` (16 kHz audio and forced first tokens -> tokens) and ``_text`` (tokens -> words).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from charstream.stages.agents.asr import TAIL_S, Transcript
from charstream.stages.ingest.audio_input import to_float_mono
from charstream.stages.ingest.resample import StreamingResampler
from charstream.stages.ingest.vad import speech_end

SAMPLE_RATE = 16_000  # what the models take
PARTIAL_EVERY_S = 0.8  # a partial transcript per this much new audio while the user speaks
MIN_PARTIAL_S = 1.0  # shorter audio is not worth a partial: the final decode is short anyway
PAUSE_S = 0.12  # quiet this long after the last loud sample: the transcript so far is guessed final
SPEECH_BLOCK = 512  # samples a block when finding the speech level (vad.speech_end)
# The end of speech found at the VAD's end may lie a little after the pause's (more quiet blocks lower
# the speech level, so a word's fading tail counts): within this, it is the same end, the guess stands
SAME_END = int(0.1 * SAMPLE_RATE)
MIN_SPEECH = int(0.02 * SAMPLE_RATE)  # less loud audio than this is nothing to transcribe
MAX_UTTERANCE_S = 24.0  # later audio of one utterance is not decoded (Whisper: its 30 s window, less padding)


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


def _trimmed(audio: np.ndarray) -> tuple[int, np.ndarray] | None:
    """(index after the last loud sample, the audio to ``TAIL_S`` after it); None: nothing loud."""
    end = speech_end(audio, SPEECH_BLOCK)
    return None if end is None else (end, audio[:end + int(TAIL_S * SAMPLE_RATE)])


class StreamingRecognizer:
    """One stream of utterances (one user), transcribed as the audio arrives.

    ``feed`` only stores the audio; a worker thread per utterance decodes it: a partial transcript
    per ``PARTIAL_EVERY_S`` of new audio and, as soon as the audio has been quiet ``PAUSE_S``, the
    transcript up to the pause (the VAD ends a turn only after 300 ms of quiet: by then this guess
    is usually done). ``end`` returns the guess if no speech came after it, else decodes the rest."""

    language_model = ""  # the model's name, for traces and benchmarks
    hold_s = 0.0  # it finds the end of speech itself: the turn's audio comes without delay
    feeds_inline = True  # ``feed`` only stores the audio (~0.1 ms): no worker thread needed for it

    def __init__(self, sample_rate: int = 48_000, partials: bool = True) -> None:
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

    def _decode(self, audio: np.ndarray, prefix: list[int]) -> list[int]:
        """The transcript's tokens for ``audio`` (16 kHz float32), forced to start with ``prefix``
        (included in the result)."""
        raise NotImplementedError

    def _text(self, tokens: list[int]) -> str:
        """The words of ``tokens``."""
        raise NotImplementedError

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
        self._worker = threading.Thread(target=self._work, args=(self._utterance,), name="asr-decode",
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
        if speech is None or speech[0] < MIN_SPEECH:
            tokens: list[int] = []
        elif utterance.guess is not None and speech[0] <= utterance.guess[0] + SAME_END:  # nothing said since
            tokens = utterance.guess[1]
            self.guessed += 1
        else:
            tokens = self._limited_decode(speech[1], utterance.stable)
        return Transcript(self._text(tokens).strip(), utterance.samples / SAMPLE_RATE,
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

    def _limited_decode(self, audio: np.ndarray, prefix: list[int]) -> list[int]:
        self.decodes += 1
        return self._decode(audio[:int(MAX_UTTERANCE_S * SAMPLE_RATE)], prefix)

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
            tokens = self._limited_decode(audio, stable if kind == "guess" else [])
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
                    utterance.partial_text = self._text(tokens).strip()
            if kind == "guess" and self.on_guess is not None:
                self.on_guess(self._text(tokens).strip())
