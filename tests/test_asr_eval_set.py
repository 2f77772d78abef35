"""The speech-recognition benchmark's evaluation set stays held out, its WER counts normalised
words, and a small run of the benchmark itself (real espeak speech, real Opus, real recognisers)."""

from __future__ import annotations

import argparse

import numpy as np
import pytest

from charstream.pipeline.bench.asr import (
    DEV_SENTENCES_FILE,
    add_arguments,
    bench,
    eval_sentences,
    microphone,
    opus_round_trip,
)
from charstream.pipeline.bench.wer import normalise, number_words, word_errors
from charstream.stages.agents.domain_lm import corpus_lines, words
from charstream.stages.agents.reply_policy import RULES


def test_evaluation_sentences_are_in_no_corpus_or_reply_rule():
    sentences = [" ".join(words(s)) for s in eval_sentences()]
    assert len(sentences) >= 30 and len(set(sentences)) == len(sentences)
    corpus = [" ".join(line) for line in corpus_lines()]
    rule_texts = [" ".join(words(text)) for rule in RULES for text in (*rule.any_of, rule.reply)]
    for sentence in sentences:
        assert not any(sentence in line for line in corpus), sentence
        assert not any(sentence in text for text in rule_texts), sentence
        # nor a whole corpus line of several words inside an evaluation sentence
        assert not any(f" {line} " in f" {sentence} " for line in corpus if len(line.split()) >= 4), sentence


def test_development_sentences_are_in_neither_the_evaluation_set_nor_a_corpus():
    dev = [" ".join(words(s)) for s in eval_sentences(DEV_SENTENCES_FILE)]
    assert len(dev) >= 12 and len(set(dev)) == len(dev)
    held_out = {" ".join(words(s)) for s in eval_sentences()}
    corpus = [" ".join(line) for line in corpus_lines()]
    rule_texts = [" ".join(words(text)) for rule in RULES for text in (*rule.any_of, rule.reply)]
    for sentence in dev:
        assert sentence not in held_out, sentence
        assert not any(sentence in line for line in corpus), sentence
        assert not any(sentence in text for text in rule_texts), sentence
        assert not any(f" {line} " in f" {sentence} " for line in corpus if len(line.split()) >= 4), sentence


def test_wer_normaliser_counts_numbers_and_punctuation_alike():
    assert normalise("The train leaves at 7:30!") == ["the", "train", "leaves", "at", "seven", "thirty"]
    assert normalise("I'm 4% sure, 1,200 times") == ["im", "four", "percent", "sure", "one", "thousand", "two",
                                                    "hundred", "times"]
    assert number_words(2026) == ["two", "thousand", "twenty", "six"]
    assert word_errors("It took us four hours.", "it took us 4 hours") == (0, 5)
    assert word_errors("It took us four hours.", "it took four flowers") == (2, 5)  # a deletion, a substitution
    assert word_errors("a b", "a b c d") == (2, 2)  # insertions count


def test_opus_round_trip_keeps_the_speech_in_time():
    mic, true_end = microphone("It took us four hours to drive to the lake.", "en-us", None, False, seed=0)
    coded = opus_round_trip(mic)
    assert len(coded) == len(mic)
    x, y = mic.astype(np.float64), coded.astype(np.float64)
    lags = range(-48, 49)
    best = max(lags, key=lambda lag: float(np.dot(x[100:-100], np.roll(y, lag)[100:-100])))
    assert abs(best) <= 8  # the codec's look-ahead is removed: the end of speech stays where it was
    assert np.corrcoef(x, y)[0, 1] > 0.5  # lossy, but the same speech
    noisy, _ = microphone("It took us four hours to drive to the lake.", "en-us", 10.0, False, seed=0)
    again, _ = microphone("It took us four hours to drive to the lake.", "en-us", 10.0, False, seed=0)
    assert np.array_equal(noisy, again) and not np.array_equal(noisy, mic)  # seeded noise


def test_a_small_benchmark_run_reports_every_condition():
    results = bench(["moonshine"], eval_sentences()[:1], ["en-us"], realtime=0)
    assert len(results["runs"]) == 6  # one voice x clean/20 dB/10 dB x raw/Opus
    clean = results["runs"]["moonshine | en-us | clean | opus"]
    assert clean["utterances"] == 1 and clean["reference_words"] == 12 and clean["vad_missed_end"] == 0
    assert clean["wer"] <= 0.25, clean["errors"]
    assert set(results["summary"]) == {f"moonshine | all voices | {noise} | {channel}"
                                       for noise in ("clean", "20 dB", "10 dB") for channel in ("raw", "opus")}


def test_a_benchmark_run_of_some_conditions_runs_only_those():
    results = bench(["whisper"], eval_sentences()[:1], ["en-us"], realtime=0, noises=["10 dB"], channels=["opus"])
    assert list(results["runs"]) == ["whisper | en-us | 10 dB | opus"]
    assert list(results["summary"]) == ["whisper | all voices | 10 dB | opus"]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--noise", "clean,10 dB", "--channel", "opus"])
    assert args.noise == ["clean", "10 dB"] and args.channel == ["opus"]
    with pytest.raises(SystemExit):
        parser.parse_args(["--noise", "5 dB"])
