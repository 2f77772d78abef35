"""The front door's Prometheus metrics, read from its state at each scrape (nothing to keep in sync)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from charstream.pipeline.fleet.frontdoor import FrontDoor


class FleetCollector(Collector):
    def __init__(self, door: FrontDoor) -> None:
        self.door = door

    def collect(self) -> Iterator[Metric]:
        status = self.door.status()
        nodes = GaugeMetricFamily("charstream_fleet_nodes", "nodes of the fleet by state", labels=["state"])
        for state in ("alive", "draining", "dead"):
            nodes.add_metric([state], sum(n["state"] == state for n in status["nodes"]))
        sessions = GaugeMetricFamily("charstream_fleet_node_sessions", "sessions admitted per node", labels=["node"])
        free = GaugeMetricFamily("charstream_fleet_node_free_layouts", "session layouts a node can still take",
                                 labels=["node"])
        for node in status["nodes"]:
            sessions.add_metric([node["node_id"]], node["sessions"])
            free.add_metric([node["node_id"]], node["free_layouts"])
        fps = GaugeMetricFamily("charstream_fleet_session_average_fps",
                                "a live session's fresh frames per second since its playout clock started",
                                labels=["session", "node"])
        presented = GaugeMetricFamily("charstream_fleet_session_presented_fps",
                                      "frames per second a live session's page reported presenting",
                                      labels=["session", "node"])
        for session in status["sessions"]:
            labels = [session["session_id"], session["node_id"]]
            if session["average_fps"] is not None:
                fps.add_metric(labels, session["average_fps"])
            if session["presented_fps"] is not None:
                presented.add_metric(labels, session["presented_fps"])
        health = status["health"]
        measured = GaugeMetricFamily("charstream_fleet_sessions_measured",
                                     "sessions with an average fps (live and recently ended)", value=health["measured"])
        slow = GaugeMetricFamily("charstream_fleet_slow_sessions", "measured sessions averaging <= slow_fps",
                                 value=health["slow"])
        share = GaugeMetricFamily("charstream_fleet_slow_session_ratio",
                                  "share of measured sessions averaging <= slow_fps (fleet health)",
                                  value=health["slow_share"] if health["slow_share"] is not None else float("nan"))
        threshold = GaugeMetricFamily("charstream_fleet_slow_fps", "the fps at or below which a session is slow",
                                      value=health["slow_fps"])
        admissions = CounterMetricFamily("charstream_fleet_admissions", "session admissions by result",
                                         labels=["result"])
        for result, count in status["admissions"].items():
            admissions.add_metric([result], count)
        yield from (nodes, sessions, free, fps, presented, measured, slow, share, threshold, admissions)
