"""JSON from the network (HTTP bodies, data-channel messages), parsed within limits.

``json.loads`` alone lets a peer raise ``RecursionError`` (an array nested 100,000 deep) or make
the parser convert a 200,000-digit number (quadratic, then ``ValueError`` past Python's digit
limit). ``loads`` refuses both up front and raises ``ValueError`` for every bad input, so callers
catch one error type.
"""

from __future__ import annotations

import json
from typing import Any

MAX_NUMBER_CHARS = 40  # longer than any float64 or int64 spelled out


def _number(text: str, kind: type) -> int | float:
    if len(text) > MAX_NUMBER_CHARS:
        raise ValueError(f"number of {len(text)} characters (most {MAX_NUMBER_CHARS})")
    return kind(text)


def _constant(name: str) -> float:
    raise ValueError(f"{name} is not JSON")


def loads(text: str | bytes) -> Any:
    """``text`` parsed as JSON; ``ValueError`` (naming the problem) for anything else."""
    try:
        return json.loads(text, parse_int=lambda s: _number(s, int), parse_float=lambda s: _number(s, float),
                          parse_constant=_constant)
    except RecursionError:  # the C scanner's own depth check: the interpreter's recursion limit
        raise ValueError("JSON nested too deep") from None
