"""A charstream session driven from inside another framework (Pipecat, LiveKit Agents).

The framework owns the conversation (its STT, LLM, TTS and turn detection); charstream renders the
character. ``EmbeddedSession`` runs a live session (``pipeline.session.LiveSession``: the full stage
graph, in this process and its stage processes) whose ingest reads the session's ``PushAdapter``
(``IngestConfig.adapter`` = ``pipecat`` or ``livekit``), and reads back what playout releases on
the 24 fps clock — each frame with its 2,000 samples of audio, so the framework's output is in
sync by construction:

    session = EmbeddedSession(config, "room-1")
    await session.start()                         # every stage set up
    await session.adapter.push(AgentTurnStart())  # ... AgentAudioFrame(...), AgentTurnEnd()
    async for frame in session.frames():          # ReleasedFrame: image (H, W, 3) + audio (2000,)
        ...
    await session.stop()
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from charstream.pipeline.config import PipelineConfig
from charstream.stages.ingest.adapters import PUSH_ADAPTERS
from charstream.stages.ingest.push import PushAdapter
from charstream.stages.playout.output import PlayoutClosed, ReleasedFrame
from charstream.stages.shared.metrics import serve_metrics


class EmbeddedSession:
    def __init__(self, config: PipelineConfig, session_id: str, weights: str | None = "packaged") -> None:
        if config.ingest.adapter not in PUSH_ADAPTERS:
            raise ValueError(f"an avatar session's ingest reads a push adapter: set ingest.adapter to one of "
                             f"{PUSH_ADAPTERS}, not {config.ingest.adapter!r}")
        from charstream.pipeline.session import LiveSession  # the demo's session API (imports egress, aiortc)

        self.session_id = session_id
        self.live: Any = LiveSession(config, session_id, weights, peer=False)
        self.adapter: PushAdapter = self.live.push_adapter

    async def start(self, timeout_s: float = 120.0) -> None:
        """Start the session; returns once every stage is set up (raises if the session failed).
        With ``tracing.prometheus_port`` set, metrics are served (once per process; a host that
        serves its own registers ``charstream.stages.shared.metrics.collector()`` instead)."""
        tracing = self.live.config.tracing
        if tracing.prometheus_port is not None:
            serve_metrics(tracing.prometheus_port, tracing.prometheus_host)
        self.live.start()
        started = asyncio.create_task(self.live.runner.started.wait())
        ended = asyncio.create_task(self.live.done.wait())
        done, pending = await asyncio.wait({started, ended}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        for task in pending:
            task.cancel()
        if ended in done or not done:
            result = await self.live.stop("start timed out" if not done else "failed to start")
            detail = (result.error or result.ended_by) if result is not None else f"not set up after {timeout_s} s"
            raise RuntimeError(f"charstream session {self.session_id} did not start: {detail}")

    async def frames(self) -> AsyncIterator[ReleasedFrame]:
        """Frames as playout releases them, from the next one on; ends when the session ends."""
        output = self.live.output
        try:
            await output.wait_started()
            index = output.next_index
            while True:
                frame = await output.frame_at(index)
                index = frame.index + 1
                yield frame
        except PlayoutClosed:
            return

    def delivered(self, turn_id: int, at: float) -> None:
        """The framework's output started sending turn ``turn_id``'s first speaking frame at ``at``
        (wall clock): the turn's ``client_first_speaking_frame``, as egress's client report is."""
        self.live.tracer.stamp(turn_id, "client_first_speaking_frame", at)

    async def stop(self, reason: str = "avatar stopped") -> Any:
        """End the session; returns its ``SessionResult``."""
        await self.adapter.end()  # ingest's iteration ends; its teardown closes the adapter
        return await self.live.stop(reason)
