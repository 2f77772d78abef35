"""Speech-recognition benchmark: word error rate and time to the final transcript of the built-in
agent's recogniser, on the project's own espeak sentences, clean and at 10 dB SNR.

    python -m charstream.pipeline.bench.asr [--json asr-bench.json] [--voices 4]

Each of the 16 sentences of ``bench_ingest`` (none of which is in the domain corpus
``stages/agents/conversation.txt``: held out) is spoken by each voice, put between silences at
48 kHz (the microphone's rate), optionally mixed with white noise at 10 dB below the speech's
power, and fed in 20 ms frames the way the built-in agent hears the microphone: silero-vad decides
the utterance, the recogniser opens at the VAD's start with the agent's pre-roll, decodes while the
audio arrives and is finalised at the VAD's end (``TurnRecognizer``: the agent's own code). Reported per language model and condition:

- WER: (substitutions + deletions + insertions) / reference words, over all utterances;
- time to final transcript after the end of speech = the VAD's detection delay (stream time from
  the last sample above -40 dBFS to the window that decided the end) + the recogniser's final
  search (measured compute time of ``end()``); the decoding during speech is not on this path.
"""

from __future__ import annotations

import argparse
import json
import time

import anyio
import numpy as np

from charstream.pipeline.bench.ingest import LINES, VOICES
from charstream.stages.agents.asr import LANGUAGE_MODELS, SpeechRecognizer, TurnRecognizer
from charstream.stages.agents.domain_lm import corpus_lines, words
from charstream.stages.agents.tts import synthesize
from charstream.stages.ingest.resample import resample, to_int16
from charstream.stages.ingest.vad import UserAudioVAD
from charstream.transport.messages import TurnKind

RATE = 48_000
FRAME = 960
SILENCE_LEVEL = 328  # -40 dBFS: the true end of speech
CONDITIONS = {"clean": None, "10 dB SNR": 10.0}


def word_errors(reference: str, hypothesis: str) -> tuple[int, int]:
    """(edit distance in words, reference length)."""
    ref, hyp = words(reference), words(hypothesis)
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        previous, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (r != h))
    return row[-1], len(ref)


def utterance(text: str, voice: str, snr_db: float | None, rng: np.random.Generator) -> tuple[np.ndarray, float]:
    """48 kHz int16 microphone audio of ``text`` and the stream time of its true end of speech."""
    speech = synthesize(text, voice)
    audio = resample(speech.samples.astype(np.float32) / 32768.0, speech.sample_rate, RATE)
    audio = np.concatenate([np.zeros(RATE // 2, np.float32), audio, np.zeros(RATE, np.float32)])
    voiced = np.abs(audio) > SILENCE_LEVEL / 32768.0
    if snr_db is not None:
        power = float(np.mean(audio[voiced] ** 2))
        audio = audio + rng.standard_normal(len(audio)).astype(np.float32) * np.sqrt(power / 10 ** (snr_db / 10))
    return to_int16(audio), float(np.flatnonzero(voiced)[-1] / RATE)


async def recognise(ears: TurnRecognizer, vad: UserAudioVAD, mic: np.ndarray) -> tuple[str, float, float]:
    """Feed ``mic`` the way the built-in agent hears it (its own ``TurnRecognizer``, driven by the
    VAD); returns (transcript, VAD end detected at (stream s), final search s)."""
    vad.reset()
    texts, detected, finalize = [], None, 0.0
    for i in range(0, len(mic), FRAME):
        frame = mic[i:i + FRAME]
        await ears.hear(frame)
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


def bench(voices: list[str]) -> dict:
    corpus = {" ".join(line) for line in corpus_lines()}
    held_in = [text for text in LINES if " ".join(words(text)) in corpus]
    results: dict = {"sentences": len(LINES), "voices": voices, "utterances": len(LINES) * len(voices),
                     "sentences_in_corpus": held_in, "runs": {}}
    vad = UserAudioVAD(sample_rate=RATE)
    for lm in LANGUAGE_MODELS:
        ears = TurnRecognizer(SpeechRecognizer(lm, RATE))
        for condition, snr in CONDITIONS.items():
            rng = np.random.default_rng(0)
            errors = reference = 0
            to_final, finals, examples = [], [], []
            started = time.perf_counter()
            for text in LINES:
                for voice in voices:
                    mic, true_end = utterance(text, voice, snr, rng)
                    heard, detected, finalize = anyio.run(recognise, ears, vad, mic)
                    e, n = word_errors(text, heard)
                    errors, reference = errors + e, reference + n
                    to_final.append(detected - true_end + finalize)
                    finals.append(finalize)
                    if voice == voices[0]:
                        examples.append({"said": text, "heard": heard})
            t = np.array(to_final) * 1000
            results["runs"][f"{lm}, {condition}"] = {
                "language_model": lm, "condition": condition, "wer": errors / reference,
                "reference_words": reference, "time_to_final_ms_median": float(np.nanmedian(t)),
                "time_to_final_ms_p90": float(np.nanpercentile(t, 90)),
                "finalize_ms_median": float(np.median(finals) * 1000), "finalize_ms_max": float(np.max(finals) * 1000),
                "vad_missed_end": int(np.isnan(t).sum()), "seconds": time.perf_counter() - started,
                "examples": examples}
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--voices", type=int, default=len(VOICES), help=f"how many of {VOICES}")
    args = parser.parse_args(argv)
    results = bench(VOICES[:args.voices])
    print(f"{results['utterances']} utterances ({results['sentences']} sentences x {len(results['voices'])} voices); "
          f"sentences also in the domain corpus: {len(results['sentences_in_corpus'])}")
    print(f"{'language model, condition':<28} {'WER':>6} {'to final p50':>13} {'p90':>7} {'final search p50':>17}")
    for name, run in results["runs"].items():
        print(f"{name:<28} {run['wer']:>6.1%} {run['time_to_final_ms_median']:>10.0f} ms {run['time_to_final_ms_p90']:>4.0f} ms"
              f" {run['finalize_ms_median']:>14.0f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
