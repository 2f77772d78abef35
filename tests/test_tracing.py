import json
import logging
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import pytest
import structlog
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from charstream.stages.config import TracingConfig
from charstream.stages.shared.metrics import REGISTRY, SessionMetrics
from charstream.stages.shared.tracing import STAGES, TurnTracer, read_jsonl
from charstream.timeline import TRACE_POINTS
from charstream.transport.messages import TraceContext


def stamps_for(t0: float, gaps=(1.2, 0.21, 0.08, 0.05, 0.1, 0.09)) -> dict[str, float]:
    out, t = {TRACE_POINTS[0]: t0}, t0
    for point, gap in zip(TRACE_POINTS[1:], gaps, strict=True):
        t += gap
        out[point] = t
    return out


def test_turn_is_written_once_when_its_last_stamp_arrives(tmp_path):
    path = tmp_path / "trace.jsonl"
    seen = []
    tracer = TurnTracer("s1", TracingConfig(jsonl_path=str(path), otel_exporter="memory"), on_turn=seen.append)
    stamps = stamps_for(1000.0)
    # Stamps arrive piecemeal from different stages, as they do in a session.
    tracer.merge(TraceContext(7, {p: stamps[p] for p in TRACE_POINTS[:3]}))
    tracer.merge(TraceContext(7, {p: stamps[p] for p in TRACE_POINTS[3:6]}))
    tracer.merge(TraceContext(7, {"conditioning_ready": 5.0}))  # a re-stamp after a retry must not win
    assert read_jsonl(path) == []  # not complete yet
    tracer.merge(TraceContext(7, {"client_first_speaking_frame": stamps["client_first_speaking_frame"]}))
    tracer.merge(TraceContext(7, {"client_first_speaking_frame": 9e9}))  # after export: ignored
    tracer.merge(TraceContext(None, {"user_speech_end": 1.0}))  # idle chunks carry no turn
    tracer.close()
    assert [r.turn_id for r in seen] == [7] and seen[0].complete
    (line,) = read_jsonl(path)
    assert line["turn_id"] == 7 and line["session_id"] == "s1" and line["complete"] and line["in_order"]
    assert line["stamps"] == stamps
    assert list(line["stamps"]) == list(TRACE_POINTS)
    assert line["segments"]["pipeline"] == pytest.approx(0.21 + 0.08 + 0.05 + 0.1)
    assert line["segments"]["total"] == pytest.approx(1.2 + 0.21 + 0.08 + 0.05 + 0.1 + 0.09)
    assert line["stages"]["diffusion"] == pytest.approx(0.08)
    assert "timestamp" in line and line["event"] == "turn"


def test_spans_nest_conversation_turn_stage_with_stamp_times():
    exporter = InMemorySpanExporter()
    tracer = TurnTracer("s2", TracingConfig(otel_exporter="memory"), exporter=exporter)
    for turn_id, t0 in ((1, 2000.0), (2, 2010.0)):
        tracer.merge(TraceContext(turn_id, stamps_for(t0)))
    tracer.close()
    spans = exporter.get_finished_spans()
    by_name: dict[str, list] = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    (conversation,) = by_name["conversation"]
    assert len(by_name["turn"]) == 2
    assert all(t.parent.span_id == conversation.context.span_id for t in by_name["turn"])
    assert {s.context.trace_id for s in spans} == {conversation.context.trace_id}
    turn1 = next(t for t in by_name["turn"] if t.attributes["charstream.turn_id"] == 1)
    stamps = stamps_for(2000.0)
    assert turn1.start_time == int(stamps["user_speech_end"] * 1e9)
    assert turn1.end_time == int(stamps["client_first_speaking_frame"] * 1e9)
    assert turn1.attributes["charstream.stamp.decode_done"] == stamps["decode_done"]
    children = [s for s in spans if s.parent is not None and s.parent.span_id == turn1.context.span_id]
    assert [c.name for c in sorted(children, key=lambda c: c.start_time)] == list(STAGES)
    for c in children:
        a, b = STAGES[c.name]
        assert (c.start_time, c.end_time) == (int(stamps[a] * 1e9), int(stamps[b] * 1e9))


def test_incomplete_turns_are_flushed_marked_incomplete(tmp_path):
    path = tmp_path / "t.jsonl"
    tracer = TurnTracer("s3", TracingConfig(jsonl_path=str(path)))
    tracer.merge(TraceContext(1, {"user_speech_end": 1.0, "agent_first_audio": 2.0}))
    tracer.merge(TraceContext(2, {"user_speech_end": 5.0}))
    tracer.flush(before_turn=2)
    assert [t["turn_id"] for t in read_jsonl(path)] == [1]
    tracer.merge(TraceContext(4, {"user_speech_end": 9.0}))
    tracer.merge(TraceContext(3, stamps_for(7.0)))  # complete: the pending turn 2 goes out before it
    assert [t["turn_id"] for t in read_jsonl(path)] == [1, 2, 3]
    tracer.close()
    lines = read_jsonl(path)
    assert [(t["turn_id"], t["complete"]) for t in lines] == [(1, False), (2, False), (3, True), (4, False)]
    assert lines[0]["segments"] == {"agent": 1.0}


def test_bad_exporter_and_bad_trace_file_are_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="otel_exporter"):
        TurnTracer("s", TracingConfig(otel_exporter="zipkin"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"event": "turn"}\nnot json\n')
    with pytest.raises(ValueError, match="bad.jsonl:2"):
        read_jsonl(bad)


class OtlpReceiver:
    """A small OTLP/HTTP traces receiver on loopback: decodes each ExportTraceServiceRequest."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

        self.requests: list = []
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's naming)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                assert self.path == "/v1/traces" and self.headers["Content-Type"] == "application/x-protobuf"
                receiver.requests.append(ExportTraceServiceRequest.FromString(body))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = HTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def spans(self) -> list[tuple[dict, object]]:
        """(resource attributes, span) for every span received."""
        out = []
        for request in self.requests:
            for rs in request.resource_spans:
                resource = {a.key: a.value.string_value for a in rs.resource.attributes}
                out += [(resource, span) for ss in rs.scope_spans for span in ss.spans]
        return out

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _attributes(span) -> dict:
    return {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in span.attributes}


@pytest.fixture
def receiver():
    r = OtlpReceiver()
    yield r
    r.close()


def test_without_a_host_provider_spans_go_where_the_otel_environment_says(receiver, monkeypatch):
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", receiver.endpoint + "/v1/traces")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "avatar-fleet")
    monkeypatch.delenv("OTEL_TRACES_EXPORTER", raising=False)
    tracer = TurnTracer("s-otlp", TracingConfig(), conversation_id="conv-9")
    tracer.merge(TraceContext(3, stamps_for(3000.0)))
    tracer.close()  # shutdown flushes the batch processor
    spans = receiver.spans()
    assert sorted(s.name for _, s in spans) == sorted(["conversation", "turn", *STAGES])
    assert {r["service.name"] for r, _ in spans} == {"avatar-fleet"}
    for _, span in spans:
        attributes = _attributes(span)
        assert (attributes["session.id"], attributes["conversation.id"]) == ("s-otlp", "conv-9")


HOST_APP = """
import sys
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from charstream.stages.config import TracingConfig
from charstream.stages.shared.tracing import TurnTracer
from charstream.transport.messages import TraceContext

provider = TracerProvider(resource=Resource.create({"service.name": "host-bot"}))
provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=sys.argv[1])))
trace.set_tracer_provider(provider)
with trace.get_tracer("host").start_as_current_span("host-call") as host:
    tracer = TurnTracer("s-host", TracingConfig(), conversation_id="call-42")
    tracer.merge(TraceContext(1, {p: 100.0 + i for i, p in enumerate(sys.argv[2:])}))
    tracer.fail(2, "decode stage failed")
    tracer.close()
print(format(host.get_span_context().trace_id, "032x"))
provider.shutdown()
"""


def test_with_a_host_provider_our_spans_join_the_host_trace(receiver):
    # a fresh process: the global provider can be set once per process
    done = subprocess.run([sys.executable, "-c", HOST_APP, receiver.endpoint + "/v1/traces", *TRACE_POINTS],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    host_trace = bytes.fromhex(done.stdout.split()[-1])
    spans = receiver.spans()
    assert {r["service.name"] for r, _ in spans} == {"host-bot"}  # the host's provider, not one of ours
    assert {s.trace_id for _, s in spans} == {host_trace}
    by_name: dict[str, list] = {}
    for _, s in spans:
        by_name.setdefault(s.name, []).append(s)
    (host,), (conversation,) = by_name["host-call"], by_name["conversation"]
    assert conversation.parent_span_id == host.span_id
    assert _attributes(conversation)["conversation.id"] == "call-42"
    turns = {_attributes(t)["charstream.turn_id"]: t for t in by_name["turn"]}
    assert set(turns) == {1, 2} and all(t.parent_span_id == conversation.span_id for t in turns.values())
    from opentelemetry.proto.trace.v1.trace_pb2 import Status

    assert turns[1].status.code != Status.STATUS_CODE_ERROR
    assert turns[2].status.code == Status.STATUS_CODE_ERROR and turns[2].status.message == "decode stage failed"
    assert len(by_name["diffusion"]) == 1 and by_name["diffusion"][0].parent_span_id == turns[1].span_id


def test_exporter_from_the_environment_is_checked(monkeypatch):
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "jaeger")
    with pytest.raises(ValueError, match="OTEL_TRACES_EXPORTER"):
        TurnTracer("s", TracingConfig())
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert TurnTracer("s", TracingConfig()).exporter is None


def test_a_failed_session_marks_its_pending_turns(tmp_path):
    exporter = InMemorySpanExporter()
    path = tmp_path / "f.jsonl"
    tracer = TurnTracer("s5", TracingConfig(jsonl_path=str(path)), exporter=exporter)
    tracer.merge(TraceContext(1, {"user_speech_end": 1.0, "agent_first_audio": 2.0}))
    tracer.close(error="diffusion: CUDA out of memory")
    (line,) = read_jsonl(path)
    assert line["error"] == "diffusion: CUDA out of memory" and not line["complete"]
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert spans["turn"].status.status_code == StatusCode.ERROR
    assert spans["conversation"].status.description == "diffusion: CUDA out of memory"


def test_session_metrics_are_labelled_and_released():
    m = SessionMetrics("metrics-session")
    m.observe_step(0.12)
    m.observe_step(0.2)
    m.set_depth(3)
    m.underrun()
    m.underrun(2)
    m.set_fps(23.9)
    value = REGISTRY.get_sample_value
    labels = {"session": "metrics-session"}
    assert value("charstream_step_seconds_count", labels) == 2
    assert value("charstream_step_seconds_sum", labels) == pytest.approx(0.32)
    assert value("charstream_playout_depth_chunks", labels) == 3
    assert value("charstream_underruns_total", labels) == 3
    assert value("charstream_fps", labels) == pytest.approx(23.9)
    before = value("charstream_session_average_fps_bucket", {"le": "24.0"}) or 0
    m.close(average_fps=23.9)
    assert value("charstream_session_average_fps_bucket", {"le": "24.0"}) == before + 1
    assert value("charstream_playout_depth_chunks", labels) is None


def test_trace_lines_are_plain_json_whatever_the_console_log_level(tmp_path):
    path = tmp_path / "x.jsonl"
    saved = structlog.get_config()
    # The demo quiets console logs to errors: trace lines must not be filtered with them.
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.ERROR))
    try:
        tracer = TurnTracer("s4", TracingConfig(jsonl_path=str(path)))
        tracer.merge(TraceContext(1, stamps_for(10.0)))
        tracer.close()
    finally:
        structlog.configure(**saved)
    (raw,) = path.read_text().splitlines()
    assert json.loads(raw)["stamps"]["user_speech_end"] == 10.0


def test_a_long_session_keeps_its_latest_turns_and_every_exported_turn_stays_closed(tmp_path):
    path = tmp_path / "trace.jsonl"
    tracer = TurnTracer("s-long", TracingConfig(jsonl_path=str(path)), records_kept=4)
    for turn in range(10):
        tracer.merge(TraceContext(turn, stamps_for(1000.0 + 10 * turn)))
    assert tracer.exported == 10 and [r.turn_id for r in tracer.records] == [6, 7, 8, 9]  # bounded in memory
    assert len(tracer._written) == 4
    # A late stamp for a turn long exported (forgotten from memory) or recently exported is not a new turn.
    for turn in (0, 5, 9):
        tracer.merge(TraceContext(turn, stamps_for(2000.0)))
        tracer.stamp(turn, "user_speech_end")
        tracer.fail(turn, "late")
    tracer.close()
    assert tracer.exported == 10
    assert [line["turn_id"] for line in read_jsonl(path)] == list(range(10))  # the file has every turn, once
