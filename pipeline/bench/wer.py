"""Word error rate for the speech-recognition benchmark, on normalised words.

Normalisation: lower case; punctuation dropped (hyphens and slashes split words, apostrophes are
removed inside words: "I'm" = "im"); numbers written in digits become words, so "7:30" and
"seven thirty" are the same two words, "4" = "four", "1,200" = "one thousand two hundred", "%" =
"percent". Spelling variants (colour/color) are not merged: the
evaluation sentences use one spelling.

    errors, reference_words = word_errors("The train leaves at seven thirty.", "the train leaves at 7:30")
"""

from __future__ import annotations

import re

_ONES = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
         "sixteen seventeen eighteen nineteen").split()
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()


def number_words(n: int) -> list[str]:
    """English words of a whole number below a million million ("hundred", "thousand", no "and")."""
    if n < 20:
        return [_ONES[n]]
    if n < 100:
        return [_TENS[n // 10]] + (number_words(n % 10) if n % 10 else [])
    for size, name in ((1_000_000_000, "billion"), (1_000_000, "million"), (1000, "thousand"), (100, "hundred")):
        if n >= size:
            return number_words(n // size) + [name] + (number_words(n % size) if n % size else [])
    raise AssertionError("unreachable")


def normalise(text: str) -> list[str]:
    """The words of ``text`` as the WER counts them."""
    text = text.lower().replace("’", "'").replace("%", " percent ")
    text = re.sub(r"(?<=\d),(?=\d{3}\b)", "", text)  # 1,200 -> 1200
    text = re.sub(r"(?<=\w)'(?=\w)", "", text)  # I'm -> im
    words: list[str] = []
    for token in re.findall(r"[a-z]+|[0-9]+", text):
        words += number_words(int(token)) if token.isdigit() and len(token) <= 12 else [token]
    return words


def word_errors(reference: str, hypothesis: str) -> tuple[int, int]:
    """(edit distance in normalised words: substitutions + deletions + insertions, reference words)."""
    ref, hyp = normalise(reference), normalise(hypothesis)
    row = list(range(len(hyp) + 1))
    for i, r in enumerate(ref, 1):
        previous, row[0] = row[0], i
        for j, h in enumerate(hyp, 1):
            previous, row[j] = row[j], min(row[j] + 1, row[j - 1] + 1, previous + (r != h))
    return row[-1], len(ref)
