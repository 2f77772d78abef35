"""Shared by the ingest tests: run an IngestStage with a context that records what it emits."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import structlog
from structlog.testing import LogCapture

from charstream.stages.base import StageContext
from charstream.transport.messages import AgentAudio, Control, Message, TurnEvent


@dataclass
class Recorder:
    """What a stage sent: data (with the wall time of each emit), control messages, log entries."""

    data: list[tuple[float, Message]] = field(default_factory=list)
    controls: list[tuple[float, Control]] = field(default_factory=list)
    logs: LogCapture = field(default_factory=LogCapture)

    def context(self, session_id: str = "s1") -> StageContext:
        async def emit(msg: Message) -> None:
            self.data.append((time.time(), msg))

        async def send_control(msg: Control) -> None:
            self.controls.append((time.time(), msg))

        log = structlog.wrap_logger(structlog.PrintLogger(), processors=[self.logs],
                                    wrapper_class=structlog.make_filtering_bound_logger(0))
        return StageContext("ingest", session_id, emit, send_control, log.bind(stage="ingest"))

    def audio(self, turn_id: int | None = None) -> list[AgentAudio]:
        return [m for _, m in self.data if isinstance(m, AgentAudio)
                and (turn_id is None or m.trace.turn_id == turn_id)]

    def turn_events(self) -> list[TurnEvent]:
        return [m for _, m in self.data if isinstance(m, TurnEvent)]

    def log_events(self, level: str) -> list[dict]:
        return [e for e in self.logs.entries if e["log_level"] == level]
