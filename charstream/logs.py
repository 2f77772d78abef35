"""structlog, configured once per process: JSON lines on stderr, context bound per session and turn.

Lines go to stderr from a writer thread through a bounded queue: a log call never blocks the
event loop, even when nobody drains stderr (a full pipe froze a whole server that logged
synchronously). Past ``QUEUE_LINES`` waiting lines, new ones are dropped and counted; the count is
written once the writer catches up. At exit the queue is drained for up to ``DRAIN_S``.

What a peer can trigger at will (a refused request, a malformed message) goes through a ``LogLimit``:
at most ``LIMITED_LINES`` lines of one event per ``LIMITED_PER_S``, the next one allowed saying how
many were left out. The standard library's loggers (aiohttp's "Error handling request" with its
traceback, asyncio's) come out as the same JSON lines, one per record, rate-limited the same way.

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
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import structlog

QUEUE_LINES = 10_000
DRAIN_S = 1.0
LIMITED_LINES = 10  # lines of one limited event per window
LIMITED_PER_S = 10.0  # the window
LEVELS = ("debug", "info", "warning", "error", "critical")  # structlog's methods, the standard levels
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


class LogLimit:
    """Per event: up to ``lines`` lines a window of ``per_s`` seconds; then counted until the next window.

    ``log_limited`` is the process's own; a session's or a channel's parts hold one each, so one noisy
    peer does not silence another's lines."""

    def __init__(self, lines: int = LIMITED_LINES, per_s: float = LIMITED_PER_S) -> None:
        self.lines, self.per_s = lines, per_s
        self._windows: dict[str, list] = {}  # event -> [window start, lines written, lines left out]
        self._lock = threading.Lock()  # stdlib records come from any thread

    def admit(self, key: str) -> int | None:
        """None: leave this line out; else the lines left out before it (0 when none)."""
        now = time.monotonic()
        with self._lock:
            window = self._windows.get(key)
            left_out = 0
            if window is None or now - window[0] >= self.per_s:
                left_out = window[2] if window is not None else 0
                if window is None and len(self._windows) >= QUEUE_LINES:  # keys are code's names: a guard only
                    self._windows.clear()
                window = self._windows[key] = [now, 0, 0]
            if window[1] >= self.lines:
                window[2] += 1
                return None
            window[1] += 1
            return left_out


    def __call__(self, emit: Callable[..., Any], event: str, *, key: str | None = None, **fields: Any) -> None:
        """``emit(event, **fields)`` (e.g. ``log.warning``) unless this event (or ``key``) has had its lines
        this window; the first line of a later window carries ``left_out``: how many were not written."""
        left_out = self.admit(key or event)
        if left_out is None:
            return
        if left_out:
            fields["left_out"] = left_out
        emit(event, **fields)


log_limited = LogLimit()


class _StdlibRecords(logging.Handler):
    """A library's log record as one JSON line (its exception as type and message), rate-limited per
    message template: a flood of malformed requests logs a few lines and a count, not a traceback each."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            fields: dict[str, Any] = {"logger": record.name}
            if record.exc_info and record.exc_info[1] is not None:
                error = record.exc_info[1]
                fields["error"] = " ".join(f"{type(error).__name__}: {error}".split())[:300]  # aiohttp's spans lines
            level = record.levelname.lower()
            logger = structlog.get_logger()
            emit = getattr(logger, level if level in LEVELS else "error")
            log_limited(emit, record.getMessage()[:300], key=f"{record.name}:{record.msg}", **fields)
        except Exception:  # a logging failure must not reach the code that logged
            self.handleError(record)


def log_level(level: str | None = None) -> str:
    """``level``, else $CHARSTREAM_LOG_LEVEL, else ``info``, checked: one of ``LEVELS`` (any case)."""
    name = level or os.environ.get("CHARSTREAM_LOG_LEVEL") or "info"
    if name.lower() not in LEVELS:
        source = "log level" if level else "CHARSTREAM_LOG_LEVEL"
        raise ValueError(f"{source}: {name!r} is not a log level (one of {', '.join(LEVELS)})")
    return name.lower()


def configure_logging(level: str | None = None) -> None:
    """JSON lines to stderr at ``level`` (default: $CHARSTREAM_LOG_LEVEL or ``info``; ``log_level``)."""
    global _configured
    if _configured:
        return
    name = log_level(level).upper()
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
    logging.getLogger().addHandler(_StdlibRecords(logging.WARNING))  # records below WARNING stay out, as before
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
