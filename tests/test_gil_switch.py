"""Every process that runs a session's threads sets its GIL switch interval from the config (the serving
process in session_factory, each stage process of ``hosting = "processes"``): model threads retake the
GIL after every CUDA call of a step, each retake waiting up to the interval while the event loop's
thread runs Python."""

from __future__ import annotations

import json
import sys

import anyio
import pytest

from charstream.pipeline.config import PipelineConfig
from charstream.pipeline.runtime.runner import Graph, Node, run_session
from charstream.pipeline.session import session_factory


def test_session_factory_sets_the_configured_switch_interval_and_rejects_a_bad_one():
    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)
        session_factory(PipelineConfig())
        assert sys.getswitchinterval() == pytest.approx(PipelineConfig().gil_switch_interval_ms / 1e3)
        assert PipelineConfig().gil_switch_interval_ms < 5.0  # below Python's own 5 ms
        config = PipelineConfig.from_dict({"gil_switch_interval_ms": 2.0})
        session_factory(config)
        assert sys.getswitchinterval() == pytest.approx(0.002)
        for bad in (0, float("nan")):  # a NaN once reached sys.setswitchinterval and aborted the interpreter
            with pytest.raises(ValueError, match="gil_switch_interval_ms: .* is not"):
                config.gil_switch_interval_ms = bad
        session_factory(config)
        assert sys.getswitchinterval() == pytest.approx(0.002)  # a rejected value changes nothing
    finally:
        sys.setswitchinterval(before)


def test_a_stage_process_sets_the_configured_switch_interval(tmp_path):
    note = tmp_path / "interval.txt"
    graph = Graph([Node("probe", "test_runner_stages:NoteProcessSettings", {"note_file": str(note)}, "probe")])
    config = PipelineConfig.from_dict({"hosting": "processes", "gil_switch_interval_ms": 1.5})
    result = anyio.run(run_session, graph, config, "s-switch")
    assert result.ok, result.error
    assert json.loads(note.read_text())["switch_interval"] == pytest.approx(0.0015)  # the child's own, not Python's 5 ms default
