"""The trace contract (docs/ARCHITECTURE.md, Tracing): per-turn stamps → JSON lines, OpenTelemetry spans, metrics.

Stages stamp the seven contract points on the ``TraceContext`` their messages carry; the stage
that sees a turn's stamps (playout for the first speaking frame, egress for the client's report)
hands them to the session's ``TurnTracer`` with ``merge``. A turn is written once, when its last
point arrives or when the session moves past it (``flush``), as

* one structlog JSON line ``{"event": "turn", "session_id", "turn_id", "stamps": {point: wall
  seconds}, "segments": {name: seconds}, "stages": {name: seconds}, "complete": bool}``, and
* OpenTelemetry spans ``conversation`` → ``turn`` → one span per stage, with explicit start/end
  times taken from the stamps and every stamp as an attribute.

Prometheus metrics are process-wide (one registry, a ``session`` label) so a fleet scrape sees
every session; a session's series are removed when it closes, and its average fps is kept in a
label-free histogram, from which the share of sessions averaging ≤ 24 fps is computable.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import structlog
from charstream.stages.config import TracingConfig
from charstream.stages.metrics import TURN_SEGMENT_SECONDS
from charstream.transport.messages import TraceContext
from opentelemetry import trace as otel_trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
)
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from charstream.timeline import TRACE_POINTS

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

    @property
    def complete(self) -> bool:
        return all(p in self.stamps for p in TRACE_POINTS)

    def to_json(self) -> dict[str, Any]:
        return {
            "session_id": self.session_id,
            "turn_id": self.turn_id,
            "stamps": {p: self.stamps[p] for p in TRACE_POINTS if p in self.stamps},
            "segments": intervals(self.stamps, SEGMENTS),
            "stages": intervals(self.stamps, STAGES),
            "complete": self.complete,
            "in_order": in_order(self.stamps),
        }


def make_span_exporter(config: TracingConfig) -> SpanExporter | None:
    kind = config.otel_exporter
    if kind == "none":
        return None
    if kind == "console":
        return ConsoleSpanExporter()
    if kind == "memory":
        return InMemorySpanExporter()
    if kind == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=config.otlp_endpoint)
    raise ValueError(f"tracing.otel_exporter must be one of {OTEL_EXPORTERS}, got {kind!r}")


def _ns(seconds: float) -> int:
    return int(seconds * 1e9)


class TurnTracer:
    """Collects one session's turn stamps and exports each turn once (JSONL + OTel spans)."""

    def __init__(self, session_id: str, config: TracingConfig | None = None, jsonl: IO[str] | None = None,
                 exporter: SpanExporter | None = None,
                 on_turn: Callable[[TurnRecord], None] | None = None) -> None:
        config = config or TracingConfig()
        self.session_id = session_id
        self.on_turn = on_turn  # called with each exported turn (progress displays, overlays)
        self.exporter = exporter if exporter is not None else make_span_exporter(config)
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
        self._provider: TracerProvider | None = None
        self._conversation = None
        if self.exporter is not None:
            self._provider = TracerProvider(resource=Resource.create({"service.name": "charstream"}))
            processor = BatchSpanProcessor(self.exporter) if config.otel_exporter == "otlp" else SimpleSpanProcessor(
                self.exporter)
            self._provider.add_span_processor(processor)
            self._otel = self._provider.get_tracer("charstream.pipeline")
            self._conversation = self._otel.start_span(
                "conversation", attributes={"charstream.session_id": session_id})
        self._turns: dict[int, TurnRecord] = {}
        self._written: set[int] = set()
        self.records: list[TurnRecord] = []  # every exported turn, in export order
        self._lock = threading.Lock()  # stamps may arrive from a stage thread (e.g. a decoder worker)

    def merge(self, trace: TraceContext) -> None:
        """Fold a message's trace stamps into its turn; exports the turn once all seven are in."""
        if trace.turn_id is None:
            return
        with self._lock:
            if trace.turn_id in self._written:
                return
            record = self._turns.setdefault(trace.turn_id, TurnRecord(self.session_id, trace.turn_id))
            for point, at in trace.stamps.items():
                if point in TRACE_POINTS:
                    record.stamps.setdefault(point, at)  # the first stamp of a point wins (retries re-stamp)
            if record.complete:
                # Earlier turns still pending never got all their stamps (their frames played first):
                # write them now, so the file stays in turn order.
                for earlier in sorted(t for t in self._turns if t < trace.turn_id):
                    self._export(self._turns.pop(earlier))
                self._export(self._turns.pop(trace.turn_id))

    def stamp(self, turn_id: int, point: str, at: float | None = None) -> None:
        self.merge(TraceContext(turn_id, {point: time.time() if at is None else at}))

    def flush(self, before_turn: int | None = None) -> None:
        """Export pending (incomplete) turns, all of them or those with id < ``before_turn``."""
        with self._lock:
            for turn_id in sorted(self._turns):
                if before_turn is None or turn_id < before_turn:
                    self._export(self._turns.pop(turn_id))

    def close(self) -> None:
        self.flush()
        if self._conversation is not None:
            self._conversation.end()
            self._conversation = None
        if self._provider is not None:
            self._provider.shutdown()
            self._provider = None
        if self._owned_file is not None:
            self._owned_file.close()
            self._owned_file = None

    def _export(self, record: TurnRecord) -> None:
        self._written.add(record.turn_id)
        self.records.append(record)
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
        if not stamps:
            return
        attributes: dict[str, Any] = {"charstream.session_id": self.session_id, "charstream.turn_id": record.turn_id,
                                      "charstream.complete": record.complete}
        attributes |= {f"charstream.stamp.{p}": at for p, at in stamps.items()}
        attributes |= {f"charstream.segment.{name}_ms": s * 1e3 for name, s in data["segments"].items()}
        parent = otel_trace.set_span_in_context(self._conversation)
        turn = self._otel.start_span("turn", context=parent, start_time=_ns(min(stamps.values())),
                                     attributes=attributes)
        inside = otel_trace.set_span_in_context(turn)
        for name, (a, b) in STAGES.items():
            if a in stamps and b in stamps:
                span = self._otel.start_span(name, context=inside, start_time=_ns(stamps[a]), attributes={
                    "charstream.turn_id": record.turn_id, f"charstream.stamp.{a}": stamps[a],
                    f"charstream.stamp.{b}": stamps[b]})
                span.end(end_time=_ns(stamps[b]))
        turn.end(end_time=_ns(max(stamps.values())))


# Prometheus series live in pipeline/metrics.py (importable without OpenTelemetry).


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """The ``turn`` records of a trace file; a line that is not JSON is an error naming the line."""
    turns = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                data = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{number}: not a JSON line ({e.msg})") from None
            if data.get("event") == "turn":
                turns.append(data)
    return turns
