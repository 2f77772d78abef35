"""Offline speech recognition with pocketsphinx (its wheel ships the US English acoustic model and
dictionary), streaming: audio is decoded while the user speaks, so the transcript is final a few
tens of milliseconds after the end of speech.

    recogniser = SpeechRecognizer(language_model="domain")   # or "general"
    recogniser.begin()
    recogniser.feed(samples_48k_int16)        # any number of times, as the microphone delivers
    transcript = recogniser.end()             # Transcript(text="how are you", ...)

Input at any supported rate is converted to the decoder's 16 kHz by the project's windowed-sinc
polyphase resampler (``stages.ingest.resample``), never by decimation. ``language_model``:
``"domain"`` (default) decodes against the conversation's trigram (``stages.ingest.domain_lm``);
``"general"`` against pocketsphinx's 72k-word English model. Which one recognises better on the
project's espeak sentences is measured by ``pipeline/bench_asr.py`` (docs/PERF.md).

A recogniser is not thread-safe; the caller serialises ``begin``/``feed``/``end`` (the built-in agent
runs them on one worker thread).
"""

from __future__ import annotations

import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from charstream.stages.ingest.audio_input import to_float_mono
from charstream.stages.ingest.domain_lm import arpa_text, corpus_lines
from charstream.stages.ingest.resample import StreamingResampler, to_int16

ASR_RATE = 16_000
LANGUAGE_MODELS = ("domain", "general")

_domain_lm_lock = threading.Lock()
_domain_lm_path: Path | None = None


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


def domain_lm_path() -> Path:
    """The domain trigram as an ARPA file, built once per process (a temporary file: pocketsphinx
    reads language models from paths)."""
    global _domain_lm_path
    with _domain_lm_lock:
        if _domain_lm_path is None:
            with tempfile.NamedTemporaryFile("w", prefix="charstream-domain-", suffix=".arpa",
                                             delete=False) as f:
                f.write(arpa_text(corpus_lines()))
            _domain_lm_path = Path(f.name)
        return _domain_lm_path


class SpeechRecognizer:
    """One stream of utterances (one user), decoded as the audio arrives."""

    def __init__(self, language_model: str = "domain", sample_rate: int = 48_000) -> None:
        if language_model not in LANGUAGE_MODELS:
            raise ValueError(f"language model must be one of {LANGUAGE_MODELS}, got {language_model!r}")
        from pocketsphinx import Decoder

        files = _model_files()
        lm = str(domain_lm_path()) if language_model == "domain" else files["general_lm"]
        self.language_model = language_model
        self.sample_rate = sample_rate
        # dither: digital silence (a WAV's, a muted track's) throws the decoder's noise estimate off;
        # on the espeak sentences it took the domain model's WER from 55% to 51% (docs/PERF.md)
        self._decoder = Decoder(hmm=files["hmm"], dict=files["dict"], lm=lm, samprate=ASR_RATE,
                                dither=True, loglevel="FATAL")
        self._resampler = StreamingResampler(sample_rate, ASR_RATE) if sample_rate != ASR_RATE else None
        self._samples = 0
        self._open = False

    @property
    def in_utterance(self) -> bool:
        return self._open

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
