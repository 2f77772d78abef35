"""A small trigram language model of the conversation's domain, for the speech recogniser.

pocketsphinx's general English model (``en-us.lm.bin``, 72k words) lets almost any word follow any
other, and on espeak speech it got about a third of the words right; what a user says to the
character is a much smaller language (greetings, questions about the character, small talk). This
builds an ARPA trigram from ``conversation.txt`` (one utterance a line) with absolute discounting
and Katz-style backoff weights, so every word sequence over the vocabulary keeps a probability —
the model prefers the domain's phrases but can still put its words together in new ways. Words
outside the vocabulary cannot be recognised at all: that is the trade (docs/AGENTS.md).

    text = arpa_text(corpus_lines())          # the ARPA file's contents
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from collections.abc import Iterable
from pathlib import Path

CORPUS = Path(__file__).with_name("conversation.txt")
DISCOUNT = 0.7  # absolute discount of each seen n-gram count (Kneser-Ney's usual range: 0.5-0.8)
ORDER = 3
SENTENCE_START, SENTENCE_END = "<s>", "</s>"


def words(text: str) -> list[str]:
    """Lower-case words of ``text`` as the dictionary spells them (apostrophes kept)."""
    return re.sub(r"[^a-z' ]+", " ", text.lower().replace("’", "'")).split()


def corpus_lines(path: Path = CORPUS) -> list[list[str]]:
    return [w for line in path.read_text().splitlines() if (w := words(line))]


def arpa_text(sentences: Iterable[list[str]]) -> str:
    """The ARPA trigram of ``sentences`` (lists of words)."""
    counts: list[Counter[tuple[str, ...]]] = [Counter() for _ in range(ORDER)]
    for sentence in sentences:
        tokens = [SENTENCE_START, *sentence, SENTENCE_END]
        for n in range(1, ORDER + 1):
            for i in range(len(tokens) - n + 1):
                gram = tuple(tokens[i:i + n])
                if gram != (SENTENCE_START,):
                    counts[n - 1][gram] += 1
    vocabulary = sorted(g[0] for g in counts[0])  # "<s>" is never predicted: not a unigram outcome
    # unigrams: discounted counts, the mass freed spread evenly over the vocabulary (no zero)
    total = sum(counts[0].values())
    freed = DISCOUNT * len(counts[0]) / total
    prob: list[dict[tuple[str, ...], float]] = [{(SENTENCE_START,): 0.0}]
    for word in vocabulary:
        prob[0][(word,)] = (counts[0][(word,)] - DISCOUNT) / total + freed / len(vocabulary)
    backoff: list[dict[tuple[str, ...], float]] = [{} for _ in range(ORDER)]
    for n in range(2, ORDER + 1):
        by_history: dict[tuple[str, ...], dict[str, int]] = defaultdict(dict)
        for gram, c in counts[n - 1].items():
            by_history[gram[:-1]][gram[-1]] = c
        level: dict[tuple[str, ...], float] = {}
        for history, followers in by_history.items():
            c_history = sum(followers.values())
            gamma = DISCOUNT * len(followers) / c_history  # mass left for the lower order
            for word, c in followers.items():
                level[(*history, word)] = (c - DISCOUNT) / c_history + gamma * _lower(prob, backoff, (*history, word))
            seen_lower = sum(_lower(prob, backoff, (*history, w)) for w in followers)
            left = 1.0 - sum(level[(*history, w)] for w in followers)
            backoff[n - 2][history] = max(left, 1e-9) / max(1.0 - seen_lower, 1e-9)
        prob.append(level)
    lines = ["\\data\\"] + [f"ngram {n + 1}={len(prob[n])}" for n in range(ORDER)] + [""]
    for n in range(ORDER):
        lines.append(f"\\{n + 1}-grams:")
        for gram, p in sorted(prob[n].items()):
            entry = f"{_log10(p) if gram != (SENTENCE_START,) else -99.0:.6f}\t{' '.join(gram)}"
            if n < ORDER - 1:
                entry += f"\t{_log10(backoff[n].get(gram, 1.0)):.6f}"
            lines.append(entry)
        lines.append("")
    lines.append("\\end\\")
    return "\n".join(lines) + "\n"


def _lower(prob: list[dict], backoff: list[dict], gram: tuple[str, ...]) -> float:
    """P(last word | the history shortened by one), by backoff (the lower orders are complete)."""
    shorter = gram[1:]
    if len(shorter) == 1:
        return prob[0][shorter]
    if shorter in prob[len(shorter) - 1]:
        return prob[len(shorter) - 1][shorter]
    return backoff[len(shorter) - 2].get(shorter[:-1], 1.0) * _lower(prob, backoff, shorter)


def _log10(p: float) -> float:
    return math.log10(max(p, 1e-99))
