"""Fleet health: each session's average fps and the share of sessions averaging at or below ``slow_fps``.

A session counts once it has played ``health_min_seconds``; live sessions count with their
average so far, ended ones with their final average (the last ``health_history`` of them).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from charstream.pipeline.fleet.config import FleetConfig


@dataclass(frozen=True)
class HealthFigures:
    measured: int  # sessions with an average (live + ended)
    slow: int  # of those, averaging <= slow_fps
    slow_fps: float

    @property
    def slow_share(self) -> float | None:
        return self.slow / self.measured if self.measured else None


class FleetHealth:
    def __init__(self, config: FleetConfig) -> None:
        self.config = config
        self.ended: deque[float] = deque(maxlen=config.health_history)  # ended sessions' averages

    def counts(self, played_s: float, average_fps: float | None) -> bool:
        return average_fps is not None and played_s >= self.config.health_min_seconds

    def record_ended(self, played_s: float, average_fps: float | None) -> None:
        if self.counts(played_s, average_fps):
            self.ended.append(average_fps)

    def figures(self, live: list[tuple[float, float | None]]) -> HealthFigures:
        """``live``: (played_s, average_fps) of the running sessions."""
        averages = list(self.ended) + [fps for played, fps in live if self.counts(played, fps)]
        return HealthFigures(len(averages), sum(fps <= self.config.slow_fps for fps in averages), self.config.slow_fps)
