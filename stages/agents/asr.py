"""Offline speech recognition with pocketsphinx (its wheel ships the US English acoustic model and
dictionary), streaming: audio is decoded while the user speaks, so the transcript is final a few
tens of milliseconds after the end of speech. The built-in agent's default recogniser is Moonshine
base (``stages.agents.moonshine``, 8% WER on held-out speech where pocketsphinx had 80-90%:
``pipeline/bench/asr.py``); Whisper tiny.en and pocketsphinx stay selectable (``ingest.recognizer``).

    recogniser = SpeechRecognizer(language_model="domain")   # or "general"
    recogniser.begin()
    recogniser.feed(samples_48k_int16)        # any number of times, as the microphone delivers
    transcript = recogniser.end()             # Transcript(text="how are you", ...)

Input at any supported rate is converted to the decoder's 16 kHz by the project's windowed-sinc
polyphase resampler (``stages.ingest.resample``), never by decimation. ``language_model``:
``"domain"`` (default) decodes against the conversation's trigram (``stages.agents.domain_lm``);
``"general"`` against pocketsphinx's 72k-word English model. Which one recognises better on the
project's espeak sentences is measured by ``pipeline/bench/asr.py`` (docs/PERF.md).

A recogniser is not thread-safe; the caller serialises ``begin``/``feed``/``end``.
``TurnRecognizer`` does that for an agent: it follows the VAD's turns (the utterance opens at the
VAD's start with the audio of the ``PREROLL_S`` before it, which the VAD needed to be sure, and is
cut ``TAIL_S`` after the last loud sample at its end), and runs every decoder call on one worker
thread at a time, in the order the audio arrived, off the event loop.
"""

from __future__ import annotations

import atexit
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import anyio
import numpy as np

from charstream.stages.agents.domain_lm import arpa_text, corpus_lines
from charstream.stages.config import RECOGNIZERS
from charstream.stages.ingest.audio_input import to_float_mono
from charstream.stages.ingest.resample import StreamingResampler, to_int16
from charstream.stages.ingest.vad import speech_end

if TYPE_CHECKING:
    from charstream.stages.agents.streaming import StreamingRecognizer

ASR_RATE = 16_000
LANGUAGE_MODELS = ("domain", "general")
PREROLL_S = 0.35  # audio kept before the VAD's start, which comes ~100 ms after the onset: LEAD_S ~0.25 s
HOLD_S = 0.45  # the newest audio of an utterance, held back until the end cuts it (> the VAD's 300 ms silence)
TAIL_S = 0.2  # silence kept after the last loud sample

_domain_lock = threading.Lock()
_domain_files: tuple[Path, Path] | None = None


@dataclass
class Transcript:
    text: str  # lower-case words, "" when nothing was recognised
    audio_s: float  # seconds of audio decoded in the utterance
    finalize_s: float  # time ``end()`` took: the decoder's last search after the end of speech


def _model_files() -> dict[str, str]:
    from pocketsphinx import get_model_path

    model = Path(get_model_path()) / "en-us"
    return {"hmm": str(model / "en-us"), "dict": str(model / "cmudict-en-us.dict"),
            "general_lm": str(model / "en-us.lm.bin")}


def domain_files() -> tuple[Path, Path]:
    """The domain trigram (ARPA) and the dictionary of its words (cmudict's entries for them),
    written once per process to temporary files (pocketsphinx reads both from paths). The small
    dictionary loads in a fraction of the full one's time (135k words)."""
    global _domain_files
    with _domain_lock:
        if _domain_files is None:
            sentences = corpus_lines()
            vocabulary = {word for sentence in sentences for word in sentence}
            with open(_model_files()["dict"], encoding="utf-8") as f:
                entries = [line for line in f if line.split(maxsplit=1)[0].split("(")[0] in vocabulary]
            with tempfile.NamedTemporaryFile("w", prefix="charstream-domain-", suffix=".arpa", delete=False) as lm, \
                    tempfile.NamedTemporaryFile("w", prefix="charstream-domain-", suffix=".dict", delete=False) as d:
                lm.write(arpa_text(sentences))
                d.writelines(entries)
            _domain_files = (Path(lm.name), Path(d.name))
            for path in _domain_files:  # removed when the process exits
                atexit.register(path.unlink, missing_ok=True)
        return _domain_files


class SpeechRecognizer:
    """One stream of utterances (one user), decoded as the audio arrives."""

    hold_s = HOLD_S  # the turn's newest audio reaches it this late (TurnRecognizer cuts the tail)

    def __init__(self, language_model: str = "domain", sample_rate: int = 48_000) -> None:
        if language_model not in LANGUAGE_MODELS:
            raise ValueError(f"language model must be one of {LANGUAGE_MODELS}, got {language_model!r}")
        from pocketsphinx import Decoder

        files = _model_files()
        if language_model == "domain":
            lm, dictionary = map(str, domain_files())
        else:
            lm, dictionary = files["general_lm"], files["dict"]
        self.language_model = language_model
        self.sample_rate = sample_rate
        # dither: digital silence (a WAV's, a muted track's) otherwise throws the decoder's noise
        # estimate off; a fixed seed, or the dither is seeded by the time and results vary by run
        self._decoder = Decoder(hmm=files["hmm"], dict=dictionary, lm=lm, samprate=ASR_RATE,
                                dither=True, seed=1, loglevel="FATAL")
        self._resampler = StreamingResampler(sample_rate, ASR_RATE) if sample_rate != ASR_RATE else None
        self._samples = 0
        self._open = False

    def begin(self) -> None:
        """Start an utterance (an open one is abandoned)."""
        if self._open:
            self._decoder.end_utt()
        if self._resampler is not None:
            self._resampler.reset()
        self._decoder.start_utt()
        self._samples, self._open = 0, True

    def feed(self, samples: np.ndarray) -> None:
        """Decode a block of the utterance's audio (mono int16 or float32 at ``sample_rate``)."""
        if not self._open:
            raise RuntimeError("feed() outside an utterance: call begin() first")
        audio, _ = to_float_mono(samples, self.sample_rate)
        if self._resampler is not None:
            audio = self._resampler.push(audio)
        self._decode(audio)

    def end(self) -> Transcript:
        """Finish the utterance and return what was recognised."""
        if not self._open:
            raise RuntimeError("end() outside an utterance")
        started = time.perf_counter()
        if self._resampler is not None:
            self._decode(self._resampler.flush())
        self._decoder.end_utt()
        self._open = False
        hypothesis = self._decoder.hyp()
        text = " ".join(_clean(hypothesis.hypstr).split()) if hypothesis is not None else ""
        return Transcript(text, self._samples / ASR_RATE, time.perf_counter() - started)

    def settle(self) -> None:
        """Nothing to wait for: ``feed`` decodes before it returns."""

    def close(self) -> None:
        """Nothing to release: the decoder is freed with the object."""

    def _decode(self, audio16k: np.ndarray) -> None:
        if len(audio16k):
            self._samples += len(audio16k)
            self._decoder.process_raw(to_int16(audio16k).tobytes(), False, False)


def _clean(hypothesis: str) -> str:
    """Drop pocketsphinx's filler and noise tokens ("<sil>", "[NOISE]", "++breath++") and
    alternate-pronunciation suffixes ("the(2)")."""
    kept = []
    for token in hypothesis.split():
        if token.startswith(("<", "[", "+")):
            continue
        kept.append(token.split("(")[0])
    return " ".join(kept)


def make_recognizer(name: str, sample_rate: int = 48_000) -> SpeechRecognizer | StreamingRecognizer:
    """The recogniser ``name`` (``stages.config.RECOGNIZERS``): "moonshine" (base, the default),
    "whisper" (tiny.en), "pocketsphinx-domain" or "pocketsphinx-general"."""
    if name == "moonshine":
        from charstream.stages.agents.moonshine import MoonshineRecognizer  # it imports this module

        return MoonshineRecognizer(sample_rate)
    if name == "whisper":
        from charstream.stages.agents.whisper import WhisperRecognizer

        return WhisperRecognizer(sample_rate)
    if name.startswith("pocketsphinx-"):
        return SpeechRecognizer(name.removeprefix("pocketsphinx-"), sample_rate)
    raise ValueError(f"speech recogniser must be one of {RECOGNIZERS}, got {name!r}")


class TurnRecognizer:
    """A recogniser driven by the VAD's turns, for an async agent.

    The utterance the decoder sees is the speech with a little silence around it: from ``LEAD_S``
    before the VAD's start to ``TAIL_S`` after the last loud sample (the VAD only ends a turn after
    300 ms of silence, and pocketsphinx turned trailing silence into words — "do you" — often).
    So the newest ``hold_s`` of an utterance is held back while the user speaks and cut at the end.
    A streaming recogniser (``hold_s`` 0) gets the audio at once and finds the end of speech itself."""

    def __init__(self, recogniser: SpeechRecognizer | StreamingRecognizer) -> None:
        self.recogniser = recogniser
        self._worker = anyio.CapacityLimiter(1)  # one decoder call at a time, in order
        self._recent = _Window(round(PREROLL_S * recogniser.sample_rate))  # before an utterance: its lead
        self._held = _Window(round(recogniser.hold_s * recogniser.sample_rate))  # in an utterance: not yet decoded
        self.listening = False  # between the VAD's start and end of the user's speech

    @classmethod
    async def load(cls, recogniser: str = "moonshine", sample_rate: int = 48_000) -> TurnRecognizer:
        return cls(await anyio.to_thread.run_sync(make_recognizer, recogniser, sample_rate))

    async def hear(self, samples: np.ndarray) -> None:
        """The user's audio as it arrives: decoded during an utterance (``HOLD_S`` behind), kept as
        lead outside one."""
        if not self.listening:
            self._recent.push(samples)
            return
        older = self._held.push(samples)
        if not len(older):
            return
        if getattr(self.recogniser, "feeds_inline", False) and not self._worker.borrowed_tokens:
            # a thread hop per 20 ms frame costs more than storing it, and on a busy machine its
            # wake-up delay holds up the VAD behind it; in order: no decoder call is in flight
            self.recogniser.feed(older)
        else:
            await anyio.to_thread.run_sync(self.recogniser.feed, older, limiter=self._worker)

    async def speech_started(self) -> None:
        if self.listening:
            return
        self.listening = True
        lead = self._recent.take()

        def begin() -> None:
            self.recogniser.begin()
            self.recogniser.feed(lead)

        await anyio.to_thread.run_sync(begin, limiter=self._worker)

    async def speech_ended(self) -> Transcript | None:
        """The VAD's end: the utterance's final transcript (None if none was open)."""
        if not self.listening:
            return None
        self.listening = False
        held = self._held.take()
        rate = self.recogniser.sample_rate
        end = speech_end(held, round(0.032 * rate)) if len(held) else None
        rest = held if end is None else held[:end + round(TAIL_S * rate)]  # nothing quiet in it: keep it all

        def finish() -> Transcript:
            self.recogniser.feed(rest)
            return self.recogniser.end()

        return await anyio.to_thread.run_sync(finish, limiter=self._worker)


    async def close(self) -> None:
        """The session is over: an utterance still open is abandoned."""
        await anyio.to_thread.run_sync(self.recogniser.close, limiter=self._worker)


class _Window:
    """The newest ``size`` samples of a stream; ``push`` returns what falls out of it."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._audio = np.zeros(0, np.int16)

    def push(self, samples: np.ndarray) -> np.ndarray:
        self._audio = np.concatenate([self._audio, np.asarray(samples).astype(np.int16, copy=False)])
        keep = max(len(self._audio) - self.size, 0)
        out, self._audio = self._audio[:keep], self._audio[keep:]
        return out

    def take(self) -> np.ndarray:
        audio, self._audio = self._audio, self._audio[:0]
        return audio
