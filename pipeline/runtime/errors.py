"""The error a task group wrapped."""

from __future__ import annotations


def unwrap(exc: BaseException) -> BaseException:
    """The one error inside ``exc`` when it is a task group's wrapping of a single error (at any
    depth), else ``exc`` itself: a report names what failed, not the group around it."""
    while isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        exc = exc.exceptions[0]
    return exc
