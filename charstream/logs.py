"""structlog, configured once per process: JSON lines on stderr, context bound per session and turn.

Lines go to stderr from a writer thread through a bounded queue: a log call never blocks the
event loop, even when nobody drains stderr (a full pipe froze a whole server that logged
synchronously). Past ``QUEUE_LINES`` waiting lines, new ones are dropped and counted; the count is
written once the writer catches up. At exit the queue is drained for up to ``DRAIN_S``.

Every process (the parent and each spawned stage process) calls ``configure_logging`` once at start;
later calls are no-ops, so library code may call it defensively. Loggers carry ``session_id`` and
``stage`` bound by the runner; a stage binds ``turn_id`` when a turn starts (``log.bind(turn_id=..)``)
or for a block with ``structlog.contextvars.bound_contextvars(turn_id=...)``.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import queue
import sys
import threading
from pathlib import Path

import structlog

QUEUE_LINES = 10_000
DRAIN_S = 1.0
_configured = False


class _BackgroundStderr:
    """A file-like for structlog whose writes are queued for a writer thread (never blocking).

    The thread writes to whatever ``sys.stderr`` is at write time: a stream swapped after
    configuration (pytest's capture, a redirect) and then closed must not break later lines."""

    def __init__(self) -> None:
        self._lines: queue.Queue[str | threading.Event] = queue.Queue(QUEUE_LINES)
        self.dropped = 0
        threading.Thread(target=self._run, name="log-writer", daemon=True).start()
        atexit.register(self.drain, DRAIN_S)

    def write(self, text: str) -> int:
        try:
            self._lines.put_nowait(text)
        except queue.Full:
            self.dropped += 1
        return len(text)

    def flush(self) -> None:
        """Nothing to do here: the writer thread flushes after each line."""

    def drain(self, timeout: float) -> None:
        """Wait (at most ``timeout`` s) until the lines queued so far are written."""
        written = threading.Event()  # a marker: the writer sets it when it gets there
        try:
            self._lines.put(written, timeout=timeout)
        except queue.Full:
            return
        written.wait(timeout)

    def _run(self) -> None:
        reported = 0
        while True:
            line = self._lines.get()
            if isinstance(line, threading.Event):
                line.set()
                continue
            if self.dropped > reported:
                count, reported = self.dropped - reported, self.dropped
                line = f'{{"event": "log_lines_dropped", "level": "warning", "count": {count}}}\n{line}'
            try:
                sys.stderr.write(line)
                sys.stderr.flush()
            except (OSError, ValueError):  # stderr closed or gone: nothing left to tell
                pass


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
        logger_factory=structlog.WriteLoggerFactory(_BackgroundStderr()),
        cache_logger_on_first_use=True,
    )
    _configured = True


def get_logger(**bound: object) -> structlog.typing.FilteringBoundLogger:
    """A logger with ``bound`` context (e.g. ``session_id``, ``stage``, ``channel``)."""
    configure_logging()
    return structlog.get_logger().bind(**bound)


def read_events(log: Path) -> list[dict]:
    """Every JSON object in a log file, in file order: the lines of several processes sharing one
    stderr may interleave, so objects are found wherever they start on a line."""
    decoder, found = json.JSONDecoder(), []
    for line in log.read_text(encoding="utf-8").splitlines():
        at = 0
        while (start := line.find('{"', at)) >= 0:
            try:
                obj, end = decoder.raw_decode(line[start:])
            except json.JSONDecodeError:
                at = start + 1
                continue
            found.append(obj)
            at = start + end
    return found
