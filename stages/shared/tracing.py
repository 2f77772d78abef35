"""The trace contract (docs/ARCHITECTURE.md, Tracing): per-turn stamps → JSON lines, OpenTelemetry spans, metrics.

Stages stamp the seven contract points on the ``TraceContext`` their messages carry; the stage
that sees a turn's stamps (playout for the first speaking frame, egress for the client's report)
hands them to the session's ``TurnTracer`` with ``merge``. A turn is written once, when its last
point arrives or when the session moves past it (``flush``), as

* one structlog JSON line ``{"event": "turn", "session_id", "turn_id", "stamps": {point: wall
  seconds}, "segments": {name: seconds}, "stages": {name: seconds}, "complete": bool}``, and
* OpenTelemetry spans ``conversation`` → ``turn`` → one span per stage, with explicit start/end
  times taken from the stamps and every stamp as an attribute; each carries ``session.id`` and
  ``conversation.id`` (Pipecat's name for it), and a failed turn (``fail``, or a session that ended
  with an error) has status ERROR.

Whose spans: an application that set the global ``TracerProvider`` gets ours in it, and the
``conversation`` span is a child of whatever span is current when the tracer is made, so our turns
sit inside the host's trace. Without one, ``tracing.otel_exporter`` picks our own provider's exporter
(unset: the standard ``OTEL_TRACES_EXPORTER``, else ``otlp`` when an ``OTEL_EXPORTER_OTLP_*ENDPOINT``
is set, else none); the resource and the OTLP endpoint come from the standard ``OTEL_*`` variables
(``OTEL_SERVICE_NAME``, default ``charstream``; ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` /
``OTEL_EXPORTER_OTLP_ENDPOINT``) unless ``tracing.otlp_endpoint`` names one.

Prometheus metrics are process-wide (one registry, a ``session`` label) so a fleet scrape sees
every session; a session's series are removed when it closes, and its average fps is kept in a
label-free histogram, from which the share of sessions averaging ≤ 24 fps is computable.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import structlog
from opentelemetry import trace as otel_trace
from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import Status, StatusCode

from charstream.stages.config import TracingConfig
from charstream.stages.shared.metrics import TURN_SEGMENT_SECONDS
from charstream.timeline import TRACE_POINTS
from charstream.transport.messages import TraceContext

# Segments of a turn (docs/ARCHITECTURE.md, Tracing): the reference's 2.13 s = agent + pipeline + delivery.
SEGMENTS: dict[str, tuple[str, str]] = {
    "agent": ("user_speech_end", "agent_first_audio"),
    "pipeline": ("agent_first_audio", "playout_first_speaking_frame"),
    "delivery": ("playout_first_speaking_frame", "client_first_speaking_frame"),
    "total": ("user_speech_end", "client_first_speaking_frame"),
}

# One span per stage: each covers the gap between consecutive contract points, named by the
# stage that stamps the later point (delivery = egress + network + the client's presentation).
STAGES: dict[str, tuple[str, str]] = {
    name: (TRACE_POINTS[i], TRACE_POINTS[i + 1])
    for i, name in enumerate(("agent", "conditioning", "diffusion", "decode", "playout", "delivery"))
}

OTEL_EXPORTERS = ("none", "console", "otlp", "memory")
# Beside the contract: the server's own view of the user's end of speech. ``user_speech_end`` is
# dated at the user's microphone (the browser's capture clock, mapped); the VAD's end on the
# server's arrival clock and the moment the VAD decided are kept as stamps of their own.
VAD_POINTS = ("vad_speech_end", "vad_decided")
# The latest exported turns a session keeps in memory (reports, benches read them); the trace file and
# the spans have every turn. A session of hours must not grow with its turns.
RECORDS_KEPT = 1024
OTLP_ENDPOINT_VARS = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")


def intervals(stamps: dict[str, float], table: dict[str, tuple[str, str]]) -> dict[str, float]:
    """Seconds between the two points of each entry of ``table`` that has both stamps."""
    return {name: stamps[b] - stamps[a] for name, (a, b) in table.items() if a in stamps and b in stamps}


def in_order(stamps: dict[str, float]) -> bool:
    """True when the present stamps are non-decreasing in contract order."""
    values = [stamps[p] for p in TRACE_POINTS if p in stamps]
    return all(a <= b for a, b in zip(values, values[1:], strict=False))


@dataclass
class TurnRecord:
    session_id: str
    turn_id: int
    stamps: dict[str, float] = field(default_factory=dict)
    error: str | None = None  # why the turn failed (``TurnTracer.fail``)
    heard: str | None = None  # what the agent's recogniser heard the user say (``TurnTracer.annotate``)
    answer: str | None = None  # what the agent answered

    @property
    def complete(self) -> bool:
        return all(p in self.stamps for p in TRACE_POINTS)

    def to_json(self) -> dict[str, Any]:
        data = {
            "session_id": self.session_id,
            "turn_id": self.turn_id,
            "stamps": {p: self.stamps[p] for p in TRACE_POINTS if p in self.stamps},
            "segments": intervals(self.stamps, SEGMENTS),
            "stages": intervals(self.stamps, STAGES),
            "complete": self.complete,
            "in_order": in_order(self.stamps),
        }
        vad = {p: self.stamps[p] for p in VAD_POINTS if p in self.stamps}
        if vad:
            data["vad"] = vad
        for name in ("heard", "answer", "error"):
            if getattr(self, name) is not None:
                data[name] = getattr(self, name)
        return data


def exporter_kind(config: TracingConfig) -> str:
    """``tracing.otel_exporter``, else what the standard OTEL_* environment asks for."""
    if config.otel_exporter is not None:
        kind = config.otel_exporter
    elif os.environ.get("OTEL_SDK_DISABLED", "").lower() == "true":
        kind = "none"
    elif os.environ.get("OTEL_TRACES_EXPORTER"):
        kind = os.environ["OTEL_TRACES_EXPORTER"].strip().lower()
    else:
        kind = "otlp" if any(os.environ.get(v) for v in OTLP_ENDPOINT_VARS) else "none"
    if kind not in OTEL_EXPORTERS:
        source = "tracing.otel_exporter" if config.otel_exporter is not None else "OTEL_TRACES_EXPORTER"
        raise ValueError(f"{source} must be one of {OTEL_EXPORTERS}, got {kind!r}")
    return kind


def make_span_exporter(config: TracingConfig) -> SpanExporter | None:
    kind = exporter_kind(config)
    if kind == "none":
        return None
    if kind == "console":
        return ConsoleSpanExporter()
    if kind == "memory":
        return InMemorySpanExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=config.otlp_endpoint)  # None: the OTEL_EXPORTER_OTLP_* endpoint


def host_provider() -> otel_trace.TracerProvider | None:
    """The application's global TracerProvider, if it set one (the API's default is a proxy)."""
    provider = otel_trace.get_tracer_provider()
    return None if isinstance(provider, (otel_trace.ProxyTracerProvider, otel_trace.NoOpTracerProvider)) else provider


def own_provider(exporter: SpanExporter, batch: bool) -> TracerProvider:
    """Our provider: resource from OTEL_SERVICE_NAME / OTEL_RESOURCE_ATTRIBUTES (service ``charstream``)."""
    resource = Resource.create({"service.name": "charstream"}).merge(OTELResourceDetector().detect())
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(exporter) if batch else SimpleSpanProcessor(exporter))
    return provider


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class TurnTracer:
    """Collects one session's turn stamps and exports each turn once (JSONL + OTel spans).

    ``exporter``: spans go to our own provider with this exporter (tests), whatever the host set."""

    def __init__(self, session_id: str, config: TracingConfig | None = None, jsonl: IO[str] | None = None,
                 exporter: SpanExporter | None = None, conversation_id: str | None = None,
                 on_turn: Callable[[TurnRecord], None] | None = None, records_kept: int = RECORDS_KEPT) -> None:
        config = config or TracingConfig()
        self.session_id = session_id
        self.conversation_id = conversation_id or session_id
        self.on_turn = on_turn  # called with each exported turn (progress displays, overlays)
        self._owned_file: IO[str] | None = None
        if jsonl is None and config.jsonl_path:
            Path(config.jsonl_path).parent.mkdir(parents=True, exist_ok=True)
            jsonl = self._owned_file = open(config.jsonl_path, "a", encoding="utf-8")  # noqa: SIM115
        # A private structlog pipeline: trace lines stay JSON, and unfiltered, whatever the console
        # logging's format and level are.
        self._jsonl = structlog.wrap_logger(
            structlog.WriteLogger(jsonl),
            processors=[structlog.processors.TimeStamper(fmt="iso", utc=True),
                        structlog.processors.JSONRenderer(sort_keys=False)],
            wrapper_class=structlog.BoundLogger,
        ) if jsonl is not None else None
        self._provider: TracerProvider | None = None  # ours (shut down on close); a host's is left alone
        provider = None if exporter is not None or config.otel_exporter is not None else host_provider()
        if provider is None:
            self.exporter = exporter if exporter is not None else make_span_exporter(config)
            if self.exporter is not None:
                provider = self._provider = own_provider(self.exporter, batch=exporter_kind(config) == "otlp")
        else:
            self.exporter = None
        self._ids = {"session.id": session_id, "conversation.id": self.conversation_id}
        self._conversation = None
        if provider is not None:
            self._otel = provider.get_tracer("charstream.pipeline")
            # no explicit context: the host's current span, if any, becomes the parent
            self._conversation = self._otel.start_span("conversation", attributes=self._ids)
        self._turns: dict[int, TurnRecord] = {}
        # Exported turns take no more stamps: the latest ``records_kept`` ids, and every id up to
        # ``_written_through`` (older ones, forgotten).
        self._written: set[int] = set()
        self._written_through = -1
        self.records: deque[TurnRecord] = deque(maxlen=records_kept)  # the latest exported turns, in export order
        self.exported = 0  # turns exported in all
        self._lock = threading.Lock()  # stamps may arrive from a stage thread (e.g. a decoder worker)

    def merge(self, trace: TraceContext) -> None:
        """Fold a message's trace stamps into its turn; exports the turn once all seven are in."""
        if trace.turn_id is None:
            return
        with self._lock:
            if self._was_written(trace.turn_id):
                return
            record = self._turns.setdefault(trace.turn_id, TurnRecord(self.session_id, trace.turn_id))
            for point, at in trace.stamps.items():
                if point in TRACE_POINTS or point in VAD_POINTS:
                    record.stamps.setdefault(point, at)  # the first stamp of a point wins (retries re-stamp)
            if record.complete:
                # Earlier turns still pending never got all their stamps (their frames played first):
                # write them now, so the file stays in turn order.
                for earlier in sorted(t for t in self._turns if t < trace.turn_id):
                    self._export(self._turns.pop(earlier))
                self._export(self._turns.pop(trace.turn_id))

    def annotate(self, turn_id: int, heard: str | None = None, answer: str | None = None) -> None:
        """What the agent heard and answered in this turn (written with the turn's record)."""
        with self._lock:
            if self._was_written(turn_id):
                return
            record = self._turns.setdefault(turn_id, TurnRecord(self.session_id, turn_id))
            record.heard, record.answer = heard, answer

    def stamp(self, turn_id: int, point: str, at: float | None = None) -> None:
        self.merge(TraceContext(turn_id, {point: time.time() if at is None else at}))

    def fail(self, turn_id: int, error: str) -> None:
        """The turn failed (``error`` says why): it is exported now, its spans with status ERROR."""
        with self._lock:
            if self._was_written(turn_id):
                return
            record = self._turns.pop(turn_id, None) or TurnRecord(self.session_id, turn_id)
            record.error = error
            self._export(record)

    def flush(self, before_turn: int | None = None, error: str | None = None) -> None:
        """Export pending (incomplete) turns, all of them or those with id < ``before_turn``;
        ``error``: they failed, for this reason."""
        with self._lock:
            for turn_id in sorted(self._turns):
                if before_turn is None or turn_id < before_turn:
                    record = self._turns.pop(turn_id)
                    record.error = error
                    self._export(record)

    def close(self, error: str | None = None) -> None:
        """Export what is pending and end the conversation; ``error``: the session failed (its
        pending turns and the conversation span get status ERROR)."""
        self.flush(error=error)
        if self._conversation is not None:
            if error is not None:
                self._conversation.set_status(Status(StatusCode.ERROR, error))
            self._conversation.end()
            self._conversation = None
        if self._provider is not None:
            self._provider.shutdown()
            self._provider = None
        if self._owned_file is not None:
            self._owned_file.close()
            self._owned_file = None

    def _was_written(self, turn_id: int) -> bool:
        return turn_id <= self._written_through or turn_id in self._written

    def _export(self, record: TurnRecord) -> None:
        self._written.add(record.turn_id)
        if len(self._written) > self.records.maxlen:
            oldest = min(self._written)
            self._written.remove(oldest)
            self._written_through = max(self._written_through, oldest)
        self.records.append(record)
        self.exported += 1
        data = record.to_json()
        for name, seconds in data["segments"].items():
            TURN_SEGMENT_SECONDS.labels(name).observe(seconds)
        if self._jsonl is not None:
            self._jsonl.info("turn", **data)
        if self._conversation is not None:
            self._export_spans(record, data)
        if self.on_turn is not None:
            self.on_turn(record)

    def _export_spans(self, record: TurnRecord, data: dict[str, Any]) -> None:
        stamps = record.stamps
        ids = self._ids | {"charstream.turn_id": record.turn_id}
        attributes: dict[str, Any] = ids | {"charstream.complete": record.complete}
        attributes |= {f"charstream.stamp.{p}": at for p, at in stamps.items()}
        attributes |= {f"charstream.segment.{name}_ms": s * 1e3 for name, s in data["segments"].items()}
        parent = otel_trace.set_span_in_context(self._conversation)
        start = min(stamps.values()) if stamps else None
        turn = self._otel.start_span("turn", context=parent, start_time=None if start is None else _ns(start),
                                     attributes=attributes)
        if record.error is not None:
            turn.set_status(Status(StatusCode.ERROR, record.error))
        inside = otel_trace.set_span_in_context(turn)
        for name, (a, b) in STAGES.items():
            if a in stamps and b in stamps:
                span = self._otel.start_span(name, context=inside, start_time=_ns(stamps[a]), attributes=ids | {
                    f"charstream.stamp.{a}": stamps[a], f"charstream.stamp.{b}": stamps[b]})
                span.end(end_time=_ns(stamps[b]))
        turn.end(end_time=_ns(max(stamps.values())) if stamps else None)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The ``turn`` records of a trace file; a line that is not JSON is an error naming the line."""
    turns = []
    with open(path, encoding="utf-8") as f:
        try:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    data = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{number}: not a JSON line ({e.msg})") from None
                if isinstance(data, dict) and data.get("event") == "turn":
                    turns.append(data)
        except UnicodeDecodeError:
            raise ValueError(f"{path}: not a trace (not UTF-8 text)") from None
    return turns
