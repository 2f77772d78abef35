"""argparse types the commands share: a bad value is a usage error naming the option, before anything starts."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterable

from charstream.stages.config import check_port


def _whole_number(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None


def port(text: str) -> int:
    """A listener's TCP port (0 picks a free one)."""
    value = _whole_number(text)
    try:
        check_port(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def positive_int(text: str) -> int:
    value = _whole_number(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def counts(text: str) -> list[int]:
    """Comma-separated whole numbers >= 1, e.g. ``1,2,4``."""
    return [positive_int(part) for part in text.split(",")]


def names(choices: Iterable[str]) -> Callable[[str], list[str]]:
    """Comma-separated names, each one of ``choices``."""
    known = sorted(choices)

    def parse(text: str) -> list[str]:
        parts = text.split(",")
        unknown = [part for part in parts if part not in known]
        if unknown:
            raise argparse.ArgumentTypeError(f"unknown {unknown}; known: {', '.join(known)}")
        return parts

    return parse


def renamed(parser: argparse.ArgumentParser, old: str, new: str) -> None:
    """Refuse option ``old`` with one line naming ``new``, the option it became."""

    class Refuse(argparse.Action):
        def __call__(self, parser, namespace, values, option_string=None) -> None:
            parser.exit(2, f"{parser.prog}: {old} is now {new}\n")

    parser.add_argument(old, action=Refuse, nargs="?", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
