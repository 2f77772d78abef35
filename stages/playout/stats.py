"""Playout's per-session figures: what reports, fleet queries and benchmarks read (``summary()``)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from enum import StrEnum


class UnderrunCause(StrEnum):
    """Why the buffer ran dry, decided where the underrun is."""

    ONSET = "onset"  # a turn start's speech not there when its frame was due (placed too early, or not placed)
    SPEECH = "speech"  # a speaking chunk of the turn late in the middle of its speech
    LISTENING = "listening"  # anything else (a listening chunk late, after a barge-in)


UNDERRUN_CAUSES: tuple[UnderrunCause, ...] = tuple(UnderrunCause)


@dataclass
class Underruns:
    """The underruns of one cause."""

    count: int = 0  # times the buffer ran dry
    frames: int = 0  # hold frames released for them


@dataclass
class PlayoutStats:
    """Counters of one session's playout (the Prometheus metrics are set beside them, by the stage)."""

    depth: int = 0
    max_depth_seen: int = 0
    frames_released: int = 0
    fresh_frames: int = 0  # released frames that came from a chunk (not held)
    by_cause: dict[UnderrunCause, Underruns] = field(default_factory=lambda: {c: Underruns() for c in UnderrunCause})
    late_chunks: int = 0  # chunks that arrived while playout was starved for them
    late_ticks: int = 0  # frames released more than one frame period after their deadline
    stale_chunks: int = 0  # chunks of an older epoch, discarded
    invalid_chunks: int = 0  # malformed chunks, discarded with an error log
    rollbacks: int = 0
    rolled_back_chunks: int = 0  # unplayed chunks dropped by rollbacks
    kept_chunks: int = 0  # unplayed chunks a turn start kept to play before the speech
    late_speech: int = 0  # turn starts whose first speech chunk arrived after it was due
    elapsed_s: float = 0.0  # from the clock's start to the end of the last released frame

    @property
    def underruns(self) -> int:
        """Times the buffer ran dry, every cause."""
        return sum(u.count for u in self.by_cause.values())

    @property
    def underrun_frames(self) -> int:
        """Hold frames released, every cause."""
        return sum(u.frames for u in self.by_cause.values())

    @property
    def achieved_fps(self) -> float:
        """Fresh frames per second of wall time: 24 when nothing stalled, less for each held frame."""
        return self.fresh_frames / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def count_underrun(self, cause: UnderrunCause) -> None:
        self.by_cause[cause].count += 1

    def count_held(self, cause: UnderrunCause) -> None:
        self.by_cause[cause].frames += 1

    def summary(self) -> dict[str, float | int]:
        """Flat: ``underruns`` and ``underrun_frames`` in all and as ``<cause>_underruns``, ``<cause>_underrun_frames``."""
        data: dict[str, float | int] = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "by_cause"}
        data.update(underruns=self.underruns, underrun_frames=self.underrun_frames)
        for cause, counts in self.by_cause.items():
            data[f"{cause}_underruns"] = counts.count
            data[f"{cause}_underrun_frames"] = counts.frames
        data["achieved_fps"] = round(self.achieved_fps, 3)
        return data
