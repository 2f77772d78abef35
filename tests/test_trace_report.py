import json
import random
import struct

import pytest

from charstream.pipeline.cli import main
from charstream.stages.config import TracingConfig
from charstream.stages.shared.tracing import TurnTracer
from charstream.timeline import TRACE_POINTS
from charstream.transport.messages import TraceContext

NAMES = {  # (first point, last point) per name, written out here rather than imported
    ("segment", "agent"): ("user_speech_end", "agent_first_audio"),
    ("segment", "pipeline"): ("agent_first_audio", "playout_first_speaking_frame"),
    ("segment", "delivery"): ("playout_first_speaking_frame", "client_first_speaking_frame"),
    ("segment", "total"): ("user_speech_end", "client_first_speaking_frame"),
    ("stage", "conditioning"): ("agent_first_audio", "conditioning_ready"),
    ("stage", "diffusion"): ("conditioning_ready", "diffusion_done"),
    ("stage", "decode"): ("diffusion_done", "decode_done"),
    ("stage", "playout"): ("decode_done", "playout_first_speaking_frame"),
}


def quantile(values: list[float], q: float) -> float:
    """Linear interpolation between order statistics (Hyndman-Fan type 7), by hand."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@pytest.fixture
def trace_file(tmp_path):
    rng = random.Random(3)
    path = tmp_path / "trace.jsonl"
    tracer = TurnTracer("report", TracingConfig(jsonl_path=str(path)))
    t = 1_700_000_000.0
    for turn in range(1, 12):
        stamps, at = {}, t
        for point in TRACE_POINTS:
            stamps[point] = at
            at += rng.uniform(0.01, 1.5)
        if turn == 11:  # one turn whose client never reported: counted where it has data
            del stamps["client_first_speaking_frame"]
        tracer.merge(TraceContext(turn, stamps))
        t += 20
    tracer.close()
    return path


def test_report_numbers_match_an_independent_recomputation(trace_file, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(["trace", "report", str(trace_file), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    raw = [json.loads(line)["stamps"] for line in trace_file.read_text().splitlines()]
    assert len(raw) == 11
    rows = {}
    for line in printed.splitlines():
        parts = line.split()
        if len(parts) >= 5 and parts[0] in ("segment", "stage"):
            rows[(parts[0], parts[1])] = (int(parts[2]), parts[3], parts[4])
    assert "11 turns (10 with all 7 stamps)" in printed
    for key, (a, b) in NAMES.items():
        values = [s[b] - s[a] for s in raw if a in s and b in s]
        n, median, p90 = rows[key]
        assert n == len(values), key
        assert int(median) == pytest.approx(quantile(values, 0.5) * 1e3, abs=0.51), key
        assert int(p90) == pytest.approx(quantile(values, 0.9) * 1e3, abs=0.51), key
    report = (out / "report.md").read_text()
    total = [s["client_first_speaking_frame"] - s["user_speech_end"] for s in raw if "client_first_speaking_frame" in s]
    assert f"| segment | total | 10 | {quantile(total, 0.5) * 1e3:.0f} | {quantile(total, 0.9) * 1e3:.0f} |" in report
    rows = {(r["kind"], r["name"]): r for r in json.loads((out / "report.json").read_text())["rows"]}
    for key, (a, b) in NAMES.items():
        values = [s[b] - s[a] for s in raw if a in s and b in s]
        assert rows[key]["median_s"] == pytest.approx(quantile(values, 0.5), abs=1e-9)
        assert rows[key]["p90_s"] == pytest.approx(quantile(values, 0.9), abs=1e-9)
    png = (out / "waterfall.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    width, height = struct.unpack(">II", png[16:24])
    assert width > 600 and height > 300


def test_report_defaults_to_the_trace_directory_and_rejects_garbage(trace_file, tmp_path, capsys):
    assert main(["trace", "report", str(trace_file)]) == 0
    assert (trace_file.parent / "waterfall.png").is_file() and (trace_file.parent / "report.md").is_file()
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{oops\n")
    assert main(["trace", "report", str(bad)]) == 2
    assert main(["trace", "report", str(tmp_path / "missing.jsonl")]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().out
    (tmp_path / "binary.jsonl").write_bytes(b"\x00\xe4\xff" * 50)  # e.g. a video passed for its trace
    assert main(["trace", "report", str(tmp_path / "binary.jsonl")]) == 2
    assert "binary.jsonl: not a trace (not UTF-8 text)" in capsys.readouterr().out
    (tmp_path / "lists.jsonl").write_text("[1, 2]\n\"turn\"\n")  # JSON lines that are not records: no turns
    assert main(["trace", "report", str(tmp_path / "lists.jsonl")]) == 1
