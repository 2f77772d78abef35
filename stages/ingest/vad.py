"""Turn detection on the user's audio with silero-vad (the model ships inside the pip package).

``UserAudioVAD.feed(samples, at_wall_time)`` takes the user's microphone audio as it arrives — 48 kHz
int16 from the WebRTC track, or any supported rate — resamples it to 16 kHz, runs silero-vad on
32 ms windows and returns the speech start/end events that became certain in this block:

- start: ``start_ms`` of consecutive windows with probability ≥ ``threshold``; ``at`` is the wall
  time the first of them began.
- end: after speech, ``silence_ms`` since the last loud sample (the refined end below) once at least
  ``MIN_QUIET_WINDOWS`` consecutive windows are below ``threshold``, or ``silence_ms`` of such
  windows (without refinement); ``at`` is back-dated to when the silence began (Pipecat's and
  LiveKit's convention), so
  ``user_speech_end`` measures the user, not the detector. ``detected_at`` says when it was known.
  silero's probability decays over ~30-100 ms after speech stops, so the silence is dated from the
  start of that decay: the first window below ``threshold + 0.2`` from which the probability fell
  without recovering into the silence window. On 64 espeak utterances (16 lines × 4 voices) this put
  the end 41 ms after the last sample above -40 dBFS on average, 91 ms at worst (dating from the
  first window below ``threshold``: 51 ms, 106 ms).

The end is then refined to the sample (``refine_end``): the last sample above the speech level —
-40 dBFS, or twice the loudest sample of the quietest window in the silence that decided the end,
if the background is louder than that — within the windows around that window boundary. Windows
are 32 ms; the user's end of speech is a sample.

Wall times come from the caller: ``at_wall_time`` is the wall clock of the block's first sample.
"""

from __future__ import annotations

import threading
import warnings
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch

from charstream.stages.ingest.audio_input import to_float_mono
from charstream.stages.ingest.resample import StreamingResampler
from charstream.transport.messages import TurnKind

VAD_RATE = 16_000
WINDOW = 512  # samples per silero window at 16 kHz (32 ms)
WINDOW_S = WINDOW / VAD_RATE
MAX_DECAY_WINDOWS = 4  # silero's probability falls within ~100 ms of the end of speech
SPEECH_LEVEL = 0.01  # -40 dBFS: the benchmarks' definition of the end of speech (last sample above it)
MIN_QUIET_WINDOWS = 3  # silero agrees it is quiet this many windows before the silence may end a turn
KEEP_WINDOWS = 32  # recent audio kept for the refinement (~1 s)

_load_lock = threading.Lock()


def load_silero() -> torch.jit.ScriptModule:
    """A fresh silero-vad JIT model (each stream needs its own: the model holds its recurrent state)."""
    with _load_lock:
        threads = torch.get_num_threads()
        with warnings.catch_warnings():  # torch 2.13 deprecates torch.jit.load, which silero uses
            warnings.simplefilter("ignore", DeprecationWarning)
            from silero_vad import load_silero_vad

            model = load_silero_vad(onnx=False)
        # silero's import sets one thread for the whole process: give the other stages theirs back
        # (the VAD sets its own around each call, see _one_thread)
        torch.set_num_threads(threads)
    model.eval()
    with _one_thread(), torch.inference_mode():  # the JIT profiles and optimises its first runs: do them now
        for _ in range(8):
            model(torch.zeros(WINDOW), VAD_RATE)
    model.reset_states()
    return model


@contextmanager
def _one_thread() -> Iterator[None]:
    """One intra-op thread around VAD work, restored after: with two threads on a busy 2-core
    machine the OpenMP workers spin against each other and a 32 ms window took up to 150 ms
    instead of 0.5-1 ms (measured). Set per call: with OpenMP the setting is per calling thread."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


@dataclass
class VadEvent:
    kind: TurnKind  # USER_SPEECH_START or USER_SPEECH_END
    at: float  # wall clock: speech onset, or the back-dated end of speech
    detected_at: float  # wall clock of the end of the window that decided it
    probability: float  # the deciding window's speech probability
    sample: int | None = None  # ``at`` as a position in the fed stream (input-rate samples from its start)


class UserAudioVAD:
    """Streaming speech start/end detector for one user's audio."""

    def __init__(self, threshold: float = 0.5, silence_ms: int = 300, start_ms: int = 64,
                 sample_rate: int = 48_000, refine_end: bool = True) -> None:
        self.refine_end = refine_end
        self.threshold = threshold
        self.decay_threshold = min(0.95, threshold + 0.2)
        self.silence_windows = max(1, round(silence_ms / (WINDOW_S * 1000)))
        self.silence_samples = round(silence_ms * VAD_RATE / 1000)
        self.start_windows = max(1, round(start_ms / (WINDOW_S * 1000)))
        self.sample_rate = sample_rate
        self._model = load_silero()
        self._resampler = StreamingResampler(sample_rate, VAD_RATE) if sample_rate != VAD_RATE else None
        self.reset()

    @property
    def speaking(self) -> bool:
        return self._speaking

    def reset(self) -> None:
        self._model.reset_states()
        if self._resampler is not None:
            self._resampler.reset()
        self._pending = np.zeros(0, np.float32)  # 16 kHz samples not yet in a full window
        self._n_in = 0  # input samples fed
        self._n_windows = 0  # windows evaluated
        self._anchor = (0.0, 0.0)  # (16 kHz sample index, its wall time), refreshed by every feed
        self._speaking = False
        self._run = 0  # consecutive speech windows (quiet) or silent windows (speaking)
        self._run_start = 0  # index of the first window of the current run
        self._decay_start: int | None = None  # first window of the current fall below decay_threshold
        self._recent: deque[np.ndarray] = deque(maxlen=KEEP_WINDOWS)  # the last windows evaluated

    def feed(self, samples: np.ndarray, at_wall_time: float) -> list[VadEvent]:
        """Feed one block of user audio (int16 or float32 mono) whose first sample was at ``at_wall_time``."""
        audio, _ = to_float_mono(samples, self.sample_rate)
        # anchor the 16 kHz index of this block's first sample to its wall time (absorbs capture gaps)
        self._anchor = (self._n_in * VAD_RATE / self.sample_rate, at_wall_time)
        self._n_in += len(audio)
        if self._resampler is not None:
            audio = self._resampler.push(audio)
        self._pending = np.concatenate([self._pending, audio])
        events = []
        if len(self._pending) < WINDOW:
            return events
        with _one_thread(), torch.inference_mode():
            while len(self._pending) >= WINDOW:
                window, self._pending = self._pending[:WINDOW], self._pending[WINDOW:]
                self._recent.append(window)
                event = self._step(float(self._model(torch.from_numpy(window.copy()), VAD_RATE)))
                if event is not None:
                    events.append(event)
                self._n_windows += 1
        return events

    def _wall(self, window_index: int) -> float:
        """Wall time of the first sample of window ``window_index``."""
        return self._wall_sample(window_index * WINDOW)

    def _wall_sample(self, sample: int) -> float:
        """Wall time of 16 kHz sample ``sample`` of the stream."""
        index, wall = self._anchor
        return wall + (sample - index) / VAD_RATE

    def _input_sample(self, sample: int) -> int:
        """16 kHz stream sample ``sample`` as an input-rate sample index."""
        return round(sample * self.sample_rate / VAD_RATE)

    def _refined_end(self, began: int, last: int) -> int:
        """The 16 kHz sample just after the last one above the speech level, searched from
        MAX_DECAY_WINDOWS before window ``began`` to two windows after it; ``began``'s first sample
        if none is (the level is set by the quietest window of the silence that ended the turn)."""
        first_kept = last + 1 - len(self._recent)
        level = speech_level(list(self._recent)[-self.silence_windows:])
        lo, hi = max(began - MAX_DECAY_WINDOWS, first_kept), min(began + 2, last + 1)
        if lo >= hi:
            return began * WINDOW
        audio = np.concatenate([self._recent[w - first_kept] for w in range(lo, hi)])
        loud = np.flatnonzero(np.abs(audio) > level)
        return lo * WINDOW + int(loud[-1]) + 1 if len(loud) else began * WINDOW


    def _step(self, p: float) -> VadEvent | None:
        i = self._n_windows
        if not self._speaking:
            if p >= self.threshold:
                if self._run == 0:
                    self._run_start = i
                self._run += 1
                if self._run >= self.start_windows:
                    self._speaking, self._run, self._decay_start = True, 0, None
                    return VadEvent(TurnKind.USER_SPEECH_START, self._wall(self._run_start), self._wall(i + 1), p,
                                    self._input_sample(self._run_start * WINDOW))
            else:
                self._run = 0
            return None
        if p >= self.decay_threshold:
            self._decay_start = None
        elif self._decay_start is None:
            self._decay_start = i
        if p >= self.threshold:
            self._run = 0
        else:
            if self._run == 0:
                self._run_start = i
            self._run += 1
            began = self._run_start
            if self._decay_start is not None:  # at most MAX_DECAY_WINDOWS earlier: a decay, not quiet speech
                began = max(min(self._decay_start, began), began - MAX_DECAY_WINDOWS)
            if self._run >= self.silence_windows:
                end = self._refined_end(began, i) if self.refine_end else began * WINDOW
            elif self.refine_end and self._run >= MIN_QUIET_WINDOWS:
                # the silence is counted from the last loud sample, not from the window where silero's
                # probability fell below the threshold, ~30-100 ms later: the turn ends silence_ms after
                # the user stopped, and a pause shorter than silence_ms still never ends it
                end = self._refined_end(began, i)
                if (i + 1) * WINDOW - end < self.silence_samples:
                    return None
            else:
                return None
            self._speaking, self._run = False, 0
            return VadEvent(TurnKind.USER_SPEECH_END, self._wall_sample(end), self._wall(i + 1), p,
                            self._input_sample(end))
        return None


def speech_level(quiet_blocks: list[np.ndarray]) -> float:
    """The level above which a sample is speech: -40 dBFS (float scale), or twice the loudest sample
    of the quietest block when the background is louder than that."""
    quiet = min((float(np.max(np.abs(b))) for b in quiet_blocks if len(b)), default=0.0)
    return max(SPEECH_LEVEL, 2.0 * quiet)


def _loud(audio: np.ndarray, block: int) -> np.ndarray:
    """Indices of the samples of ``audio`` (int16 or float) above the speech level, the level set by its
    quietest ``block``-sample block."""
    x = audio.astype(np.float32) / 32768.0 if audio.dtype == np.int16 else np.asarray(audio, np.float32)
    blocks = [x[i:i + block] for i in range(0, len(x) - block + 1, block)] or [x]
    return np.flatnonzero(np.abs(x) > speech_level(blocks))


def speech_start(audio: np.ndarray, block: int) -> int | None:
    """Index of the first sample of ``audio`` above the speech level (``speech_end``'s rule); None if none."""
    loud = _loud(audio, block)
    return int(loud[0]) if len(loud) else None


def speech_end(audio: np.ndarray, block: int) -> int | None:
    """Index just after the last sample of ``audio`` (int16 or float) above the speech level, the
    level set by its quietest ``block``-sample block; None if no sample is above it."""
    loud = _loud(audio, block)
    return int(loud[-1]) + 1 if len(loud) else None
