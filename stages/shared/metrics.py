"""Prometheus metrics per session: step time, playout depth, underruns, fps; fleet-wide session fps.

Only ``prometheus_client`` here, so any stage process (the GPU ones too) can record. Every process
records into ``REGISTRY``; a scrape must also see the stage processes a session spawns
(``hosting = "processes"``: diffusion's step time is recorded in a child), so the process that
serves metrics first calls ``share_with_children()``: ``PROMETHEUS_MULTIPROC_DIR`` is set before any
child is spawned, children inherit it and record through prometheus_client's multiprocess mode
(memory-mapped files), and ``collector()`` merges those files with this process's own series.
``forget_processes`` drops an exited child's files with its session (a closed session's series
go away, as they do in-process).

``serve_metrics(port, host)`` exposes it over HTTP (loopback unless configured), with the serving
process's process metrics (``process_*``: CPU, memory, open fds); a model engine serves its own
(``charstream engine --metrics-port``: its hosted sessions' step times) and forgets a session's series
when it stops hosting it (``forget_session``), since that session's playout closes elsewhere. A host that already serves
Prometheus registers ``collector()`` in its own registry instead.
"""

from __future__ import annotations

import atexit
import glob
import os
import shutil
import tempfile
import threading
import warnings
from collections.abc import Iterable, Iterator

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    start_http_server,
)
from prometheus_client import values as prometheus_values
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

REGISTRY = CollectorRegistry(auto_describe=True)
STEP_SECONDS = Histogram("charstream_step_seconds", "diffusion step time", ["session"], registry=REGISTRY,
                         buckets=(0.01, 0.025, 0.05, 0.1, 0.15, 0.1667, 0.2, 0.3, 0.5, 1.0, 2.5))
# gauges of live processes only, the latest value (multiprocess mode; in-process they are plain gauges)
PLAYOUT_DEPTH = Gauge("charstream_playout_depth_chunks", "chunks waiting in the playout buffer", ["session"],
                      registry=REGISTRY, multiprocess_mode="livemostrecent")
UNDERRUNS = Counter("charstream_underruns", "playout ticks with no chunk ready", ["session"], registry=REGISTRY)
FPS = Gauge("charstream_fps", "frames per second released by playout (recent)", ["session"], registry=REGISTRY,
            multiprocess_mode="livemostrecent")
SESSION_FPS = Histogram("charstream_session_average_fps", "a closed session's average fps", registry=REGISTRY,
                        buckets=(12, 20, 23, 23.5, 23.9, 24.0, 24.1, 25, 30))
TURN_SEGMENT_SECONDS = Histogram("charstream_turn_segment_seconds", "turn latency segments", ["segment"],
                                 registry=REGISTRY, buckets=(0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1, 1.5, 2, 3, 5))


def recording_to_files() -> bool:
    """This process records into the multiprocess directory (it was set when prometheus_client was
    imported here: a spawned child's case)."""
    return prometheus_values.ValueClass is not prometheus_values.MutexValue


def share_with_children() -> str:
    """Make the stage processes spawned from now on record where ``collector()`` reads; returns the
    directory (an existing ``PROMETHEUS_MULTIPROC_DIR`` is used as it is)."""
    path = os.environ.get(MULTIPROC_ENV)
    if not path:
        path = tempfile.mkdtemp(prefix="charstream-metrics-")
        atexit.register(shutil.rmtree, path, True)
        os.environ[MULTIPROC_ENV] = path
    return path


def forget_processes(pids: Iterable[int]) -> None:
    """Exited children's series go with their session: remove their multiprocess files."""
    path = os.environ.get(MULTIPROC_ENV)
    if not path:
        return
    for pid in pids:
        for name in glob.glob(os.path.join(path, f"*_{pid}.db")):
            os.remove(name)


class SessionsCollector(Collector):
    """This process's ``REGISTRY`` and, when children share a multiprocess directory, their series,
    merged into one family per metric name (a scrape must not see a name twice)."""

    def collect(self) -> Iterator[Metric]:
        path = os.environ.get(MULTIPROC_ENV)
        sources: list = [] if recording_to_files() else [REGISTRY]  # a child's own series are in the files
        if path and os.path.isdir(path):
            scratch = CollectorRegistry()
            MultiProcessCollector(scratch, path=path)
            sources.append(scratch)
        merged: dict[str, Metric] = {}
        for source in sources:
            for family in source.collect():
                if family.name in merged:
                    merged[family.name].samples.extend(family.samples)
                else:
                    merged[family.name] = family
        yield from merged.values()


def collector() -> SessionsCollector:
    return SessionsCollector()


_server_lock = threading.Lock()
_served: tuple[str, int] | None = None


def serve_metrics(port: int, host: str = "127.0.0.1") -> None:
    """Expose charstream's metrics (all processes) and this process's process metrics on
    ``http://host:port/metrics`` (once per process)."""
    global _served
    with _server_lock:
        if _served is None:
            share_with_children()
            registry = CollectorRegistry()
            registry.register(collector())
            ProcessCollector(registry=registry)
            start_http_server(port, addr=host, registry=registry)
            _served = (host, port)
        elif _served != (host, port):
            raise RuntimeError(f"metrics already served on {_served[0]}:{_served[1]}, not {host}:{port}")


class SessionMetrics:
    """One session's labelled series; ``close`` records its average fps and drops the series."""

    def __init__(self, session_id: str) -> None:
        self.session_id = session_id

    def observe_step(self, seconds: float) -> None:
        STEP_SECONDS.labels(self.session_id).observe(seconds)

    def set_depth(self, chunks: int) -> None:
        PLAYOUT_DEPTH.labels(self.session_id).set(chunks)

    def underrun(self, n: int = 1) -> None:
        UNDERRUNS.labels(self.session_id).inc(n)

    def set_fps(self, fps: float) -> None:
        FPS.labels(self.session_id).set(fps)

    def close(self, average_fps: float | None) -> None:
        if average_fps is not None:
            SESSION_FPS.observe(average_fps)
        forget_session(self.session_id)


def forget_session(session_id: str) -> None:
    """Drop a session's series from this process (its playout's close; an engine, whose hosted stages
    record a session whose playout closes elsewhere, when it tears the session's group down)."""
    if recording_to_files():  # a stage process: its files go with it (forget_processes)
        return
    with warnings.catch_warnings():  # "not implemented in multi-process mode": this process's own series
        warnings.simplefilter("ignore", UserWarning)
        for metric in (STEP_SECONDS, PLAYOUT_DEPTH, UNDERRUNS, FPS):
            try:
                metric.remove(session_id)
            except KeyError:  # the session never touched this series
                pass
