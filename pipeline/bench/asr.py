"""Speech-recognition benchmark: word error rate and time to the final transcript of the built-in
agent's recognisers, on speech the system never saw.

    charstream bench asr [--json asr-bench.json] [--recognizers moonshine,whisper]
                         [--sentences 32] [--realtime 32] [--dev] [--noise "10 dB"] [--channel opus]

The sentences are ``pipeline/bench/asr_sentences.txt``: written for this benchmark and used for
nothing else (no language model, grammar or reply rule has them: tests/test_asr_eval_set.py); settings
are chosen on ``asr_dev_sentences.txt`` (``--dev``), a separate set held out the same way. Each
is spoken by each espeak-ng voice, put between silences at 48 kHz (the microphone's rate), mixed
with seeded white noise at 20 and 10 dB below the speech's power or not, and sent or not through
the Opus round trip a browser's microphone takes (libopus through PyAV, 48 kHz mono, 20 ms frames,
32 kbit/s, VoIP mode: WebRTC's usual voice settings). The audio is fed in 20 ms frames the way the
built-in agent hears the microphone: silero-vad decides the utterance and the agent's own
``TurnRecognizer`` follows it. Reported per recogniser and condition (voice x noise x opus):

- WER: (substitutions + deletions + insertions) / reference words over all utterances, on words
  normalised by ``pipeline/bench/wer.py`` (case, punctuation; numbers in digits or words alike).
  Audio is fed faster than real time, and after each frame the recogniser's background decoding is
  waited for (``settle``), so partial transcripts are made as they would be live and the WER does
  not depend on the machine's load.
- after VAD end: compute time of the final transcript after the VAD decided the end (``end()``),
  in that settled feed (what is left when the machine keeps up with the speech);
- ``--realtime N``: the first N sentences of each voice again, clean through Opus, fed at real
  time (one frame per 20 ms), so decoding in the background competes with the speech as it would
  live: the final transcript's time after the VAD's end, and after the true end of speech (the
  VAD's detection delay in stream time + that), median and p90. These figures depend on the load.

``--noise`` and ``--channel`` run only some conditions. A voice's utterances are synthesised once per
run, before its conditions, in the same order whichever conditions run, so a filtered run hears the
same audio as the full one (espeak-ng's output depends on what the process synthesised before).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import anyio
import av
import numpy as np

from charstream.pipeline import arguments
from charstream.pipeline.bench.wer import word_errors
from charstream.stages.agents.asr import TurnRecognizer, make_recognizer
from charstream.stages.agents.tts import synthesize
from charstream.stages.config import RECOGNIZERS
from charstream.stages.ingest.resample import resample, to_int16
from charstream.stages.ingest.vad import UserAudioVAD
from charstream.transport.messages import TurnKind

SENTENCES_FILE = Path(__file__).with_name("asr_sentences.txt")
DEV_SENTENCES_FILE = Path(__file__).with_name("asr_dev_sentences.txt")  # for choosing settings, not reporting
VOICES = ["en-us", "en+m3", "en+f3"]
NOISE = {"clean": None, "20 dB": 20.0, "10 dB": 10.0}  # SNR: speech power over white noise power
CHANNELS = ("raw", "opus")  # the microphone's samples as they are, or after the Opus round trip
RATE = 48_000
FRAME = 960  # 20 ms
OPUS_BITRATE = 32_000
SILENCE_LEVEL = 328  # -40 dBFS: the true end of speech


def eval_sentences(path: Path = SENTENCES_FILE) -> list[str]:
    """The evaluation-only sentences (comments and blank lines skipped)."""
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]


@functools.cache
def spoken(text: str, voice: str) -> np.ndarray:
    """``text`` in ``voice`` at 48 kHz float32, between 0.5 s and 1 s of silence."""
    speech = synthesize(text, voice)
    audio = resample(speech.samples.astype(np.float32) / 32768.0, speech.sample_rate, RATE)
    return np.concatenate([np.zeros(RATE // 2, np.float32), audio, np.zeros(RATE, np.float32)])


def opus_round_trip(audio: np.ndarray, bitrate: int = OPUS_BITRATE) -> np.ndarray:
    """48 kHz int16 mono ``audio`` encoded and decoded by libopus in 20 ms frames (same length out)."""
    encoder = av.CodecContext.create("libopus", "w")
    encoder.sample_rate, encoder.format, encoder.layout, encoder.bit_rate = RATE, "s16", "mono", bitrate
    encoder.options = {"application": "voip", "frame_duration": "20"}
    decoder = av.CodecContext.create("libopus", "r")
    decoder.sample_rate, decoder.layout = RATE, "mono"
    padded = np.concatenate([audio, np.zeros(-len(audio) % FRAME + FRAME, np.int16)])
    out: list[np.ndarray] = []
    frames = [None]  # the encoder's flush
    for i in range(0, len(padded), FRAME):
        frame = av.AudioFrame.from_ndarray(padded[None, i:i + FRAME], format="s16", layout="mono")
        frame.sample_rate, frame.pts = RATE, i
        frames.insert(-1, frame)
    for frame in frames:
        for packet in encoder.encode(frame):
            for decoded in decoder.decode(packet):
                out.append(decoded.to_ndarray().reshape(-1))
    decoded = np.concatenate(out)
    if decoded.dtype != np.int16:  # the decoder's float planar output
        decoded = to_int16(decoded.astype(np.float32))
    skip = int(encoder.delay) if getattr(encoder, "delay", 0) else 312  # the encoder's look-ahead (pre-skip)
    return decoded[skip:skip + len(audio)]


def microphone(text: str, voice: str, snr_db: float | None, opus: bool, seed: int) -> tuple[np.ndarray, float]:
    """48 kHz int16 microphone audio of ``text`` and the stream time of its true end of speech."""
    audio = spoken(text, voice)
    voiced = np.abs(audio) > SILENCE_LEVEL / 32768.0
    if snr_db is not None:
        power = float(np.mean(audio[voiced] ** 2))
        noise = np.random.default_rng(seed).standard_normal(len(audio)).astype(np.float32)
        audio = audio + noise * np.sqrt(power / 10 ** (snr_db / 10))
    mic = to_int16(audio)
    return (opus_round_trip(mic) if opus else mic), float(np.flatnonzero(voiced)[-1] / RATE)


async def recognise(ears: TurnRecognizer, vad: UserAudioVAD, mic: np.ndarray,
                    realtime: bool) -> tuple[str, float, float]:
    """Feed ``mic`` the way the built-in agent hears it (its own ``TurnRecognizer``, driven by the
    VAD); returns (transcript, VAD end detected at (stream s), final transcript's compute s)."""
    vad.reset()
    texts, detected, finalize = [], None, 0.0
    started = time.perf_counter()
    for i in range(0, len(mic), FRAME):
        if realtime:
            await anyio.sleep(max(0.0, started + i / RATE - time.perf_counter()))
        frame = mic[i:i + FRAME]
        await ears.hear(frame)
        if not realtime:
            await anyio.to_thread.run_sync(ears.recogniser.settle)
        for event in vad.feed(frame, i / RATE):
            if event.kind == TurnKind.USER_SPEECH_START:
                await ears.speech_started()
            else:
                transcript = await ears.speech_ended()
                if transcript is not None:
                    texts.append(transcript.text)
                    detected, finalize = event.detected_at, finalize + transcript.finalize_s
    transcript = await ears.speech_ended()  # the VAD never ended it: count what was decoded, flag the delay
    if transcript is not None:
        texts.append(transcript.text)
    return " ".join(texts), (detected if detected is not None else float("nan")), finalize


def run_condition(ears: TurnRecognizer, vad: UserAudioVAD, sentences: list[str], voices: list[str],
                  snr_db: float | None, opus: bool, realtime: bool) -> dict:
    errors = reference = 0
    finals, to_final, examples = [], [], []
    started = time.perf_counter()
    for n, text in enumerate(sentences):
        for voice in voices:
            mic, true_end = microphone(text, voice, snr_db, opus, seed=n)
            heard, detected, finalize = anyio.run(recognise, ears, vad, mic, realtime)
            e, words = word_errors(text, heard)
            errors, reference = errors + e, reference + words
            finals.append(finalize * 1000)
            to_final.append((detected - true_end + finalize) * 1000)
            if e:
                examples.append({"voice": voice, "said": text, "heard": heard})
    return {"wer": errors / reference, "reference_words": reference, "utterances": len(finals),
            "after_vad_ms_p50": float(np.median(finals)), "after_vad_ms_p90": float(np.percentile(finals, 90)),
            "after_true_end_ms_p50": float(np.nanmedian(to_final)),
            "after_true_end_ms_p90": float(np.nanpercentile(to_final, 90)),
            "vad_missed_end": int(np.isnan(to_final).sum()), "seconds": time.perf_counter() - started,
            "errors": examples}


def machine() -> dict:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    return {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "load_1min": os.getloadavg()[0], "commit": commit}


def bench(recognizers: list[str], sentences: list[str], voices: list[str], realtime: int,
          noises: list[str] | None = None, channels: list[str] | None = None) -> dict:
    """Every recogniser over every voice x noise (of ``noises``, default all) x channel (of
    ``channels``: "raw", "opus"; default both), plus the real-time feed if ``realtime``."""
    results: dict = {"sentences": len(sentences), "voices": voices, "machine_at_start": machine(), "runs": {}}
    vad = UserAudioVAD(sample_rate=RATE)
    for name in recognizers:
        ears = TurnRecognizer(make_recognizer(name, RATE))
        for voice in voices:
            for text in sentences:  # one order of synthesis, whichever conditions run
                spoken(text, voice)
            for noise, snr in NOISE.items():
                if noises is not None and noise not in noises:
                    continue
                for opus in (False, True):
                    if channels is not None and ("opus" if opus else "raw") not in channels:
                        continue
                    key = f"{name} | {voice} | {noise} | {'opus' if opus else 'raw'}"
                    results["runs"][key] = {"recognizer": name, "voice": voice, "noise": noise, "opus": opus,
                                            "mode": "settled",
                                            **run_condition(ears, vad, sentences, [voice], snr, opus, False)}
                    print(f"{key}: WER {results['runs'][key]['wer']:.1%}", file=sys.stderr, flush=True)
        if realtime:
            key = f"{name} | all voices | clean | opus | real time"
            results["runs"][key] = {"recognizer": name, "voice": "all", "noise": "clean", "opus": True,
                                    "mode": "realtime", "load_1min_before": os.getloadavg()[0],
                                    **run_condition(ears, vad, sentences[:realtime], voices, None, True, True)}
            results["runs"][key]["load_1min_after"] = os.getloadavg()[0]
    results["summary"] = summary(results["runs"])
    results["machine_at_end"] = machine()
    return results


def summary(runs: dict) -> dict:
    """WER per recogniser x noise x opus over all voices (word-weighted)."""
    table: dict[str, dict] = {}
    for run in runs.values():
        if run["mode"] != "settled":
            continue
        key = f"{run['recognizer']} | all voices | {run['noise']} | {'opus' if run['opus'] else 'raw'}"
        row = table.setdefault(key, {"errors": 0.0, "words": 0, "after_vad_ms_p50": []})
        row["errors"] += run["wer"] * run["reference_words"]
        row["words"] += run["reference_words"]
        row["after_vad_ms_p50"].append(run["after_vad_ms_p50"])
    return {key: {"wer": row["errors"] / row["words"], "after_vad_ms_p50": float(np.median(row["after_vad_ms_p50"]))}
            for key, row in table.items()}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--recognizers", type=arguments.names(RECOGNIZERS), default=",".join(RECOGNIZERS),
                        help=f"comma-separated, of {', '.join(RECOGNIZERS)}")
    parser.add_argument("--sentences", type=arguments.positive_int, default=None,
                        help="only the first N evaluation sentences")
    parser.add_argument("--dev", action="store_true",
                        help="the development sentences instead (for choosing settings; report the evaluation set)")
    parser.add_argument("--voices", type=arguments.positive_int, default=len(VOICES), help=f"how many of {VOICES}")
    parser.add_argument("--realtime", type=int, default=0,
                        help="also feed the first N sentences per voice at real time (clean, Opus) for latency")
    parser.add_argument("--noise", type=arguments.names(NOISE), default=None,
                        help=f"only these noise conditions, comma-separated, of {', '.join(NOISE)} (default all)")
    parser.add_argument("--channel", type=arguments.names(CHANNELS), default=None,
                        help=f"only these channels, comma-separated, of {', '.join(CHANNELS)} (default both)")


def run(args: argparse.Namespace) -> int:
    sentences = eval_sentences(DEV_SENTENCES_FILE if args.dev else SENTENCES_FILE)[:args.sentences]
    results = bench(args.recognizers, sentences, VOICES[:args.voices], args.realtime, args.noise, args.channel)
    m = results["machine_at_start"]
    print(f"{len(sentences)} {'development' if args.dev else 'held-out'} sentences x {len(results['voices'])} voices; {m['cores']} cores, "
          f"load {m['load_1min']:.1f} -> {results['machine_at_end']['load_1min']:.1f}, commit {m['commit']}")
    print(f"{'recogniser | voice | noise | channel':<52} {'WER':>6} {'after VAD end p50':>18} {'p90':>7}"
          f" {'after true end p50':>19}")
    for name, run in results["runs"].items():
        print(f"{name:<52} {run['wer']:>6.1%} {run['after_vad_ms_p50']:>15.0f} ms {run['after_vad_ms_p90']:>4.0f} ms"
              f" {run['after_true_end_ms_p50']:>16.0f} ms")
    print("over all voices:")
    for name, row in results["summary"].items():
        print(f"{name:<52} {row['wer']:>6.1%} {row['after_vad_ms_p50']:>15.0f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
