"""Prometheus metrics per session: step time, playout depth, underruns, fps; fleet-wide session fps.

Only ``prometheus_client`` here, so any stage process (the GPU ones too) can record into its own
process's ``REGISTRY``; ``serve_metrics`` exposes the registry of the process that calls it.
"""

from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

REGISTRY = CollectorRegistry(auto_describe=True)
STEP_SECONDS = Histogram("charstream_step_seconds", "diffusion step time", ["session"], registry=REGISTRY,
                         buckets=(0.01, 0.025, 0.05, 0.1, 0.15, 0.1667, 0.2, 0.3, 0.5, 1.0, 2.5))
PLAYOUT_DEPTH = Gauge("charstream_playout_depth_chunks", "chunks waiting in the playout buffer", ["session"],
                      registry=REGISTRY)
UNDERRUNS = Counter("charstream_underruns", "playout ticks with no chunk ready", ["session"], registry=REGISTRY)
FPS = Gauge("charstream_fps", "frames per second released by playout (recent)", ["session"], registry=REGISTRY)
SESSION_FPS = Histogram("charstream_session_average_fps", "a closed session's average fps", registry=REGISTRY,
                        buckets=(12, 20, 23, 23.5, 23.9, 24.0, 24.1, 25, 30))
TURN_SEGMENT_SECONDS = Histogram("charstream_turn_segment_seconds", "turn latency segments", ["segment"],
                                 registry=REGISTRY, buckets=(0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1, 1.5, 2, 3, 5))

_server_lock = threading.Lock()
_server_port: int | None = None


def serve_metrics(port: int) -> None:
    """Expose ``REGISTRY`` on ``http://0.0.0.0:port/metrics`` (once per process)."""
    global _server_port
    with _server_lock:
        if _server_port is None:
            start_http_server(port, registry=REGISTRY)
            _server_port = port
        elif _server_port != port:
            raise RuntimeError(f"metrics already served on port {_server_port}, not {port}")


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
        for metric in (STEP_SECONDS, PLAYOUT_DEPTH, UNDERRUNS, FPS):
            try:
                metric.remove(self.session_id)
            except KeyError:  # the session never touched this series
                pass
