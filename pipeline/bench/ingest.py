"""Ingest benchmark: VAD end-of-speech accuracy and cost, resampler accuracy and cost.

    charstream bench ingest [--json ingest-bench.json]

- VAD: 16 espeak lines × 4 voices, each between silences, fed in 20 ms frames at 48 kHz; the error
  is the back-dated end of speech minus the true end (last sample above -40 dBFS), and a "split"
  is an utterance the VAD cut in two (a pause longer than the silence window).
- resampler: a 1 kHz tone to the 48 kHz timeline, SNR against the exact tone; time per second of
  audio.
- resampler against the libraries that could replace it (``--libraries``: PyAV's swresample, and
  soxr when installed — it comes with the pipecat extra), streaming 22.05 kHz in 20 ms chunks to
  48 kHz as ingest does: tone SNR, gain and image level at 0.9 of the input Nyquist, the most
  output held back while streaming (latency), exact output count, time per second of audio.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from charstream.stages.agents.tts import synthesize
from charstream.stages.ingest.resample import resample, to_int16
from charstream.stages.ingest.vad import UserAudioVAD
from charstream.transport.messages import TurnKind

LINES = [
    "Can you hear me through the microphone?", "What time does the museum open on Sunday?",
    "Hello, can you tell me about the weather today?", "Okay.", "Tell me a story about a dragon.",
    "Good morning.", "I would like to book a table for two, please.", "Hmm, let me think about that for a second.",
    "Why is the sky blue?", "Please stop talking.", "Sorry, can I stop you there?", "What is the weather like today?",
    "Wait, what about tomorrow?", "Hi there! Who am I talking to?", "How do you make your face move?",
    "That sounds great. Thank you!",
]
VOICES = ["en-us", "en+m3", "en+f3", "en-us+f2"]


def bench_vad() -> dict:
    vad = UserAudioVAD()
    errors, splits, window_s = [], 0, []
    for text in LINES:
        for voice in VOICES:
            speech = synthesize(text, voice)
            audio = resample(speech.samples.astype(np.float32) / 32768.0, speech.sample_rate, 48_000)
            signal = to_int16(np.concatenate([np.zeros(24_000), audio, np.zeros(48_000)]))
            true_end = np.flatnonzero(np.abs(signal.astype(np.int32)) > 328)[-1] / 48_000
            vad.reset()
            ends = []
            for i in range(0, len(signal), 960):
                t = time.perf_counter()
                ends += [e.at for e in vad.feed(signal[i:i + 960], i / 48_000) if e.kind == TurnKind.USER_SPEECH_END]
                window_s.append((time.perf_counter() - t) / (960 / 512))
            splits += len(ends) != 1
            errors.append(ends[-1] - true_end)
    e = np.array(errors) * 1000
    return {"utterances": len(errors), "end_error_ms_mean": float(e.mean()), "end_error_ms_median": float(np.median(e)),
            "end_error_ms_p90": float(np.percentile(e, 90)), "end_error_ms_max": float(e.max()),
            "end_error_ms_min": float(e.min()), "over_100ms": int((np.abs(e) > 100).sum()), "split_utterances": splits,
            "ms_per_32ms_window_median": float(np.median(window_s) * 1000)}


def bench_resampler() -> dict:
    out = {}
    for rate in (16_000, 22_050, 24_000, 44_100):
        x = (0.5 * np.sin(2 * np.pi * 1_000 * np.arange(rate * 2) / rate)).astype(np.float32)
        t = time.perf_counter()
        y = resample(x, rate, 48_000)
        elapsed = time.perf_counter() - t
        ref = 0.5 * np.sin(2 * np.pi * 1_000 * np.arange(len(y)) / 48_000)
        inner = slice(2_000, -2_000)
        snr = 10 * np.log10(np.mean(ref[inner] ** 2) / np.mean((y[inner] - ref[inner]) ** 2))
        out[str(rate)] = {"snr_db": float(snr), "ms_per_audio_s": elapsed / 2 * 1000}
    return out


class _Swr:
    """PyAV's swresample behind the StreamingResampler interface (push / flush)."""

    def __init__(self, in_rate: int, out_rate: int) -> None:
        import av

        self._av, self._in_rate, self._pts = av, in_rate, 0
        self._resampler = av.AudioResampler(format="flt", layout="mono", rate=out_rate)

    def _run(self, frame) -> np.ndarray:
        return np.concatenate([np.zeros(0, np.float32)] + [o.to_ndarray().ravel() for o in self._resampler.resample(frame)])

    def push(self, x: np.ndarray) -> np.ndarray:
        frame = self._av.AudioFrame.from_ndarray(np.ascontiguousarray(x[None, :]), format="flt", layout="mono")
        frame.sample_rate, frame.pts = self._in_rate, self._pts
        self._pts += len(x)
        return self._run(frame)

    def flush(self) -> np.ndarray:
        return self._run(None)


class _Soxr:
    def __init__(self, in_rate: int, out_rate: int, quality: str) -> None:
        import soxr

        self._stream = soxr.ResampleStream(in_rate, out_rate, 1, dtype="float32", quality=quality)

    def push(self, x: np.ndarray) -> np.ndarray:
        return self._stream.resample_chunk(x)

    def flush(self) -> np.ndarray:
        return self._stream.resample_chunk(np.zeros(0, np.float32), last=True)


def bench_resampler_libraries(rate: int = 22_050) -> dict:
    from charstream.stages.ingest.resample import StreamingResampler

    makers = {"charstream (polyphase)": lambda: StreamingResampler(rate, 48_000), "PyAV swresample": lambda: _Swr(rate, 48_000)}
    try:
        import soxr  # noqa: F401
        makers |= {"soxr LQ": lambda: _Soxr(rate, 48_000, "LQ"), "soxr HQ": lambda: _Soxr(rate, 48_000, "HQ")}
    except ImportError:
        print("soxr not installed: compared against PyAV only")
    step = rate // 50

    def stream(make, x: np.ndarray) -> tuple[np.ndarray, float, float]:
        r, parts, held, n = make(), [], 0.0, 0
        t = time.perf_counter()
        for i in range(0, len(x), step):
            parts.append(r.push(x[i:i + step]))
            n += len(parts[-1])
            held = max(held, min(i + step, len(x)) * 48_000 / rate - n)
        parts.append(r.flush())
        return np.concatenate(parts), held, time.perf_counter() - t

    def level_db(y: np.ndarray, lo: float, hi: float) -> float:
        y = y[3_000:-3_000] * np.hanning(len(y) - 6_000)
        power = np.abs(np.fft.rfft(y)) ** 2
        freqs = np.fft.rfftfreq(len(y), 1 / 48_000)
        return float(10 * np.log10(power[(freqs > lo) & (freqs < hi)].sum() / power.sum() + 1e-30))

    out = {}
    tone = (0.5 * np.sin(2 * np.pi * 1_000 * np.arange(rate * 2) / rate)).astype(np.float32)
    high = 0.9 * rate / 2
    near_nyquist = np.sin(2 * np.pi * high * np.arange(rate) / rate).astype(np.float32)
    for name, make in makers.items():
        y, held, elapsed = stream(make, tone)
        ref = 0.5 * np.sin(2 * np.pi * 1_000 * np.arange(len(y)) / 48_000)
        inner = slice(4_000, -4_000)
        snr = 10 * np.log10(np.mean(ref[inner] ** 2) / np.mean((y[inner] - ref[inner]) ** 2))
        z, _, _ = stream(make, near_nyquist)
        gain = 20 * np.log10(np.sqrt(np.mean(z[3_000:-3_000] ** 2)) / np.sqrt(0.5))
        image = rate - high
        out[name] = {"snr_db": float(snr), "gain_db_at_0.9_nyquist": float(gain),
                     "image_db_at_0.9_nyquist": level_db(z, image - 50, image + 50),
                     "held_back_samples_max": float(held), "exact_count": len(y) == -(-len(tone) * 48_000 // rate),
                     "ms_per_audio_s": elapsed / 2 * 1000}
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--libraries", action="store_true", help="only: the resampler against PyAV and soxr")


def run(args: argparse.Namespace) -> int:
    if args.libraries:
        libs = bench_resampler_libraries()
        print("| 22.05 -> 48 kHz, 20 ms chunks | SNR 1 kHz | gain at 0.9 Nyquist | image at 0.9 Nyquist | "
              "held back (max) | exact count | ms per s |\n|---|---|---|---|---|---|---|")
        for name, r in libs.items():
            print(f"| {name} | {r['snr_db']:.1f} dB | {r['gain_db_at_0.9_nyquist']:.2f} dB | "
                  f"{r['image_db_at_0.9_nyquist']:.1f} dB | {r['held_back_samples_max']:.0f} samples | "
                  f"{r['exact_count']} | {r['ms_per_audio_s']:.2f} |")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"resampler_libraries": libs}, f, indent=2)
        return 0
    vad, res = bench_vad(), bench_resampler()
    print(f"VAD end of speech, {vad['utterances']} utterances: error mean {vad['end_error_ms_mean']:.0f} ms, "
          f"median {vad['end_error_ms_median']:.0f}, p90 {vad['end_error_ms_p90']:.0f}, "
          f"max {vad['end_error_ms_max']:.0f}, min {vad['end_error_ms_min']:.0f}; "
          f"> 100 ms: {vad['over_100ms']}; split: {vad['split_utterances']}")
    print(f"VAD cost: {vad['ms_per_32ms_window_median']:.2f} ms per 32 ms window (median, incl. 48->16 kHz)")
    print("| rate -> 48 kHz | SNR (1 kHz tone) | ms per s of audio |\n|---|---|---|")
    for rate, r in res.items():
        print(f"| {rate} | {r['snr_db']:.1f} dB | {r['ms_per_audio_s']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"vad": vad, "resampler": res}, f, indent=2)
    return 0

