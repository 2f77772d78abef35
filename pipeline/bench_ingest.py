"""Ingest benchmark: VAD end-of-speech accuracy and cost, resampler accuracy and cost.

    python -m charstream.pipeline.bench_ingest [--json ingest-bench.json]

- VAD: 16 espeak lines × 4 voices, each between silences, fed in 20 ms frames at 48 kHz; the error
  is the back-dated end of speech minus the true end (last sample above -40 dBFS), and a "split"
  is an utterance the VAD cut in two (a pause longer than the silence window).
- resampler: a 1 kHz tone to the 48 kHz timeline, SNR against the exact tone; time per second of
  audio.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from charstream.stages.ingest.resample import resample, to_int16
from charstream.stages.ingest.tts import synthesize
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
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


if __name__ == "__main__":
    raise SystemExit(main())
