"""Bounds of a config section's numbers, declared beside each field and checked as the field is set.

    offer_timeout_s: float = field(default=30.0, metadata=within(1, 3600))

Every number of a section is checked the same way whether it comes from a config file, a command-line
option, an engine's request or code (construction and later assignment alike): finite, of the field's
type, and within the declared bounds; ``off`` names a value that means "disabled" outside them (a trim
interval of 0). A section's cross-field rules (a depth beyond its buffer, a per-client cap above the
total) go in its ``check_together``, run once all fields are set. Each refusal is one ``ValueError``
line naming ``section.key``.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

BOUNDS = "bounds"  # the metadata key


@dataclass(frozen=True)
class Bounds:
    low: float
    high: float
    low_open: bool = False  # low itself is refused
    high_open: bool = False  # high itself is refused
    off: float | None = None  # a value outside [low, high] that turns the feature off
    what: str | None = None  # how a refusal names the range (default: the interval)

    def describe(self) -> str:
        if self.what is not None:
            return self.what
        interval = f"{'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"
        return f"a number in {interval}" + ("" if self.off is None else f" or {self.off:g} (off)")

    def admits(self, value: float) -> bool:
        if self.off is not None and value == self.off:
            return True
        return ((self.low < value if self.low_open else self.low <= value)
                and (value < self.high if self.high_open else value <= self.high))


def within(low: float, high: float, *, low_open: bool = False, high_open: bool = False, off: float | None = None,
           what: str | None = None) -> dict[str, Bounds]:
    """A field's metadata: its value lies in [low, high] (an end excluded when open), or is ``off``."""
    return {BOUNDS: Bounds(low, high, low_open, high_open, off, what)}


PORT = within(0, 65535, what="a TCP port (0-65535; 0 picks a free one)")


@functools.cache
def _numeric_fields(cls: type) -> dict[str, tuple[type, Bounds | None]]:
    """The fields of ``cls`` holding a number (int or float, optionally None, or a dict of them)."""
    hints = typing.get_type_hints(cls)
    found = {}
    for f in dataclasses.fields(cls):
        kinds = set(typing.get_args(hints[f.name])) or {hints[f.name]}
        if typing.get_origin(hints[f.name]) is dict:
            kinds = {typing.get_args(hints[f.name])[1]}
        number = kinds & {int, float}
        if number:
            found[f.name] = (float if float in number else int, f.metadata.get(BOUNDS))
    return found


def check_number(key: str, value: Any, kind: type, bounds: Bounds | None) -> None:
    """Refuse ``value`` for ``key`` unless it is a finite ``kind`` within ``bounds``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral if kind is int else numbers.Real):
        raise ValueError(f"{key}: expected {'a whole number' if kind is int else 'a number'}, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{key}: {value!r} is not a finite number")
    if bounds is not None and not bounds.admits(value):
        raise ValueError(f"{key}: {value!r} is not {bounds.describe()}")


class CheckedSection:
    """Base of a dataclass config section: its numbers are checked when set, its rules once built."""

    SECTION: ClassVar[str] = ""  # the key of the section in the pipeline config ("" at its root)

    def __setattr__(self, name: str, value: Any) -> None:
        spec = _numeric_fields(type(self)).get(name)
        if spec is not None and value is not None:
            key = f"{self.SECTION}.{name}" if self.SECTION else name
            for item in value.values() if isinstance(value, dict) else (value,):
                check_number(key, item, *spec)
        super().__setattr__(name, value)
        if self.__dict__.get("_built"):  # a later assignment: the section's rules still hold
            self.check_together()

    def __post_init__(self) -> None:
        if self.__dataclass_params__.frozen:  # set without __setattr__: its numbers are checked here
            for name, spec in _numeric_fields(type(self)).items():
                value = getattr(self, name)
                for item in () if value is None else value.values() if isinstance(value, dict) else (value,):
                    check_number(self.key(name), item, *spec)
        self.check_together()
        object.__setattr__(self, "_built", True)

    def check_together(self) -> None:
        """Rules between fields (override; raise ``ValueError`` naming the keys)."""

    def key(self, name: str) -> str:
        """``name``'s full key (``section.name``), as a refusal names it."""
        return f"{self.SECTION}.{name}" if self.SECTION else name

    def refuse(self, name: str, problem: str) -> None:
        raise ValueError(f"{self.key(name)}: {problem}")
