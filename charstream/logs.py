"""structlog, configured once per process: JSON lines on stderr, context bound per session and turn.

Every process (the parent and each spawned stage process) calls ``configure_logging`` once at start;
later calls are no-ops, so library code may call it defensively. Loggers carry ``session_id`` and
``stage`` bound by the runner; a stage binds ``turn_id`` when a turn starts (``log.bind(turn_id=..)``)
or for a block with ``structlog.contextvars.bound_contextvars(turn_id=...)``.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog

_configured = False


class _CurrentStderr:
    """Whatever ``sys.stderr`` is at write time: a stream swapped after configuration (pytest's
    capture, a redirect) and then closed must not break every later log line."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(level: str | None = None) -> None:
    """JSON lines to stderr at ``level`` (default: $CHARSTREAM_LOG_LEVEL or ``info``)."""
    global _configured
    if _configured:
        return
    name = (level or os.environ.get("CHARSTREAM_LOG_LEVEL", "info")).upper()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.getLevelNamesMapping()[name]),
        logger_factory=structlog.PrintLoggerFactory(_CurrentStderr()),
        cache_logger_on_first_use=True,
    )
    _configured = True


def get_logger(**bound: object) -> structlog.typing.FilteringBoundLogger:
    """A logger with ``bound`` context (e.g. ``session_id``, ``stage``, ``channel``)."""
    configure_logging()
    return structlog.get_logger().bind(**bound)
