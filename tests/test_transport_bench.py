"""``charstream bench transport --json``: the report's contract (tiny run, inproc only)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from charstream.pipeline.bench import transport
from charstream.pipeline.cli import main


def _report(tmp_path, capsys, *args: str) -> dict:
    """The JSON report of ``bench transport --json`` with ``args``: printed, and the same in its ``--out`` file."""
    out = tmp_path / "bench.json"
    assert main(["bench", "transport", "--json", *args, "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text())
    return printed


def test_bench_transport_json_report(tmp_path, capsys):
    printed = _report(tmp_path, capsys, "--transports", "inproc", "--small", "30", "--large", "5",
                      "--backpressure", "12", "--capacity", "3")
    result = printed["transports"]["inproc"]
    for name in ("conditioning", "video_chunk"):
        assert result[name]["p99_ms"] >= result[name]["p50_ms"] > 0 and result[name]["msgs_per_s"] > 0
    assert 9_000_000 < result["video_chunk"]["bytes"] < 9_300_000
    backpressure = result["backpressure"]
    assert backpressure["capacity"] == 3 and 1 <= backpressure["max_in_flight"] <= 3
    assert printed["targets"]["max_in_flight_le_capacity"] is True
    assert {"commit", "date", "machine", "versions"} <= set(printed)


def test_bench_transport_ipc_sends_video_through_slots_beside_raw_zeromq(tmp_path, capsys):
    printed = _report(tmp_path, capsys, "--transports", "ipc", "--small", "20", "--large", "6",
                      "--backpressure", "8", "--capacity", "2")
    result = printed["transports"]["ipc"]
    assert result["video_chunk"]["slotted"] == 6 and result["conditioning"]["slotted"] == 0  # 53 kB: inline
    for name in ("conditioning", "video_chunk"):
        r = result[name]
        assert r["p50_vs_raw_zmq_xproc"] == round(r["p50_ms"] / r["raw_zmq_xproc"]["p50_ms"], 2)
    assert {"ipc_video_chunk_p50_le_1.2x_raw_zmq_xproc", "ipc_video_chunk_p99_le_5ms"} <= set(printed["targets"])
    assert printed["load_avg_1m_at_start"] >= 0
    # 9.2 MB is 2,250 pages: a fresh array per message would fault in each; pooled buffers are reused
    assert result["video_chunk"]["receiver_faults_per_message"] < 200
    # libzmq leaves a bound ipc socket's file: they are in the run's own folder, which goes at exit
    sockets = {p.name.rsplit("-", 1)[0] for p in Path(transport._ipc_folder()).glob("*.sock")}
    assert sockets == {"channel", "raw", "raw-cross"}, sockets


def test_bench_transport_takes_the_video_shape_and_slot_size(tmp_path, capsys):
    """``--video`` sizes the chunk (a FlashHead-shaped one here, small); a chunk larger than
    ``--slot-bytes`` crosses ipc inline."""
    printed = _report(tmp_path, capsys, "--transports", "ipc", "--small", "4", "--large", "4",
                      "--backpressure", "4", "--capacity", "2", "--video", "28x64x64", "--slot-bytes", "65536")
    video = printed["transports"]["ipc"]["video_chunk"]
    assert printed["video"] == [28, 64, 64] and printed["slot_bytes"] == 65536
    assert 28 * 64 * 64 * 3 < video["bytes"] < 28 * 64 * 64 * 3 + 70_000 and video["slotted"] == 0
    assert printed["transports"]["ipc"]["backpressure"]["message_mb"] == round(video["bytes"] / 1e6, 2)
    with pytest.raises(SystemExit):
        main(["bench", "transport", "--video", "28x512"])
    assert "expected FRAMESxHxW" in capsys.readouterr().err
