"""Every serving process imports what its sessions run and freezes its heap out of Python's full
collections (``PipelineConfig.freeze_heap``, ``pipeline/runtime/heap.py``): a full collection of a loaded
server's heap held the GIL 110-156 ms, long enough to hold a speaking frame."""

from __future__ import annotations

import gc
import json
import subprocess
import sys

import anyio
import structlog

from charstream.pipeline.config import PipelineConfig
from charstream.pipeline.runtime import heap
from charstream.pipeline.runtime.runner import Graph, Node, run_session

SERVER = """
import gc, json, sys, time
from charstream.pipeline.config import PipelineConfig
from charstream.pipeline.session import session_factory
config = PipelineConfig.from_dict({"freeze_heap": sys.argv[1] == "on"})
session_factory(config)
started = time.perf_counter()
gc.collect()
print(json.dumps({"frozen": gc.get_freeze_count(), "tracked": len(gc.get_objects()),
                  "full_collection_s": time.perf_counter() - started,
                  "imported": [m in sys.modules for m in ("charstream.model.generator", "silero_vad", "sympy")]}))
"""


def server_process(freeze: str) -> dict:
    run = subprocess.run([sys.executable, "-c", SERVER, freeze], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_a_server_imports_what_its_sessions_run_then_freezes_its_heap():
    on, off = server_process("on"), server_process("off")
    assert on["imported"] == off["imported"] == [True, True, True]  # the model, the VAD, torch's sympy: before serving
    assert off["frozen"] == 0
    # Frozen: what a full collection walks is a small part of the heap, not all of it.
    assert on["frozen"] > 4 * on["tracked"], on
    assert on["tracked"] + on["frozen"] > 0.8 * off["tracked"], (on, off)  # the same heap, frozen
    assert on["full_collection_s"] < off["full_collection_s"], (on, off)


def test_a_stage_process_freezes_after_importing_its_stages_modules(tmp_path):
    notes = {}
    for name, freeze in (("diffusion", True), ("probe", True), ("decode", False)):
        note = tmp_path / f"{name}.json"
        graph = Graph([Node(name, "test_runner_stages:NoteProcessSettings", {"note_file": str(note)}, name)])
        config = PipelineConfig.from_dict({"hosting": "processes", "freeze_heap": freeze})
        result = anyio.run(run_session, graph, config, f"s-heap-{name}")
        assert result.ok, result.error
        notes[name] = json.loads(note.read_text())
    assert notes["diffusion"]["model_imported"] and notes["diffusion"]["frozen"] > 0
    assert not notes["probe"]["model_imported"] and notes["probe"]["frozen"] > 0  # no model stage: no model imports
    assert notes["decode"]["model_imported"] and notes["decode"]["frozen"] == 0  # freeze_heap off: imports only


def test_collections_past_the_threshold_are_logged_once_per_process():
    before = list(gc.callbacks)
    heap.log_long_collections(0.0)  # every collection, for this test
    heap.log_long_collections(0.0)
    try:
        assert sum(isinstance(cb, heap._CollectionTimer) for cb in gc.callbacks) == 1
        gc.disable()  # until the collection below: an automatic one would free some of the cycles first
        for _ in range(200):  # cycles only a collection frees
            a: list = []
            a.append(a)
        del a  # all 200 unreachable
        with structlog.testing.capture_logs() as logs:
            gc.collect()
        [pause] = [e for e in logs if e["event"] == "gc_pause" and e["generation"] == 2]
        assert pause["collected"] >= 200 and pause["ms"] >= 0 and pause["component"] == "gc", pause
        heap.log_long_collections(60.0)  # a threshold no collection here reaches: nothing logged
        with structlog.testing.capture_logs() as logs:
            gc.collect()
        assert not [e for e in logs if e["event"] == "gc_pause"]
    finally:  # this test process as it was: its own timer, if it had one, at the default threshold
        gc.enable()
        gc.callbacks[:] = before
        if any(isinstance(cb, heap._CollectionTimer) for cb in before):
            heap.log_long_collections()
