"""One live character session: the stage graph of docs/ARCHITECTURE.md (Stages) run by ``pipeline.runner``.

    ingest ─► conditioning ─► diffusion ─► decode ─► playout ─► (PlayoutOutput) ─► egress (WebRTC)

Ingest, conditioning and playout live in the caller's process (group ``main``: asyncio, next to
egress); diffusion and decode get process groups of their own, which ``placement = "processes"``
spawns and ``"inproc"`` (the CPU demo, tests) keeps in one process. Egress is not a graph node: it
serves the session's ``PlayoutOutput`` (``stages.playout.session_output``) to a peer connection,
and ``session_factory`` is what the egress server calls for each new peer.

The user's microphone (a browser's, through egress) is fed to ingest's VAD, except with the
scripted agent, which plays the user itself. Each session owns a ``TurnTracer``: playout merges
the first speaking frame's trace into it, egress the client's report; it writes the turn to the
trace JSONL and exports OpenTelemetry spans.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import os
from collections.abc import Callable
from typing import Any

from charstream.pipeline.config import PipelineConfig
from charstream.pipeline.runner import Edge, Graph, Node, Session, SessionResult
from charstream.stages.egress.mic import UserAudioQueue
from charstream.stages.egress.server import SessionFactory, SessionMedia
from charstream.stages.playout import PlayoutOutput, session_output
from charstream.stages.tracing import TurnRecord, TurnTracer


def build_graph(config: PipelineConfig, tracer: TurnTracer | None = None, user_audio: UserAudioQueue | None = None,
                weights: str | None = "packaged") -> Graph:
    """The session's stages and edges. ``weights``: a weights file, ``"packaged"`` (the trained
    weights shipped for the preset, when present) or None (seeded random weights). ``tracer`` and
    ``user_audio`` are live objects handed to nodes of the caller's process (group ``main``)."""
    model = {"preset": config.preset, "weights": weights}
    # On CPU, diffusion and decode run side by side: half the cores each, no oversubscription.
    threads = {"threads": max(1, (os.cpu_count() or 2) // 2)}
    return Graph(
        nodes=[
            Node("ingest", "charstream.stages.ingest.stage:IngestStage", {"config": config.ingest, "user_audio": user_audio}),
            Node("conditioning", "charstream.stages.conditioning:build",
                 dict(model, seed=config.diffusion.seed, **dataclasses.asdict(config.conditioning))),
            Node("diffusion", "charstream.stages.diffusion:DiffusionStage",
                 dict(model, **threads if config.diffusion.device == "cpu" else {}), group="diffusion"),
            Node("decode", "charstream.stages.decode:DecodeStage",
                 dict(model, **threads if config.decode.device == "cpu" else {}), group="decoder"),
            # Same process as egress: the tracer object is handed over, not pickled.
            Node("playout", "charstream.stages.playout:PlayoutStage", {"tracer": tracer}),
        ],
        edges=[
            Edge("ingest", "conditioning"),
            # One step in hand at each model stage: enough to overlap, little to throw away on rollback.
            Edge("conditioning", "diffusion", capacity=1),
            Edge("diffusion", "decode", capacity=1),
            Edge("decode", "playout", capacity=2),
        ],
    )


class LiveSession:
    """A running session: its runner ``Session``, tracer and playout output."""

    def __init__(self, config: PipelineConfig, session_id: str, weights: str | None = "packaged",
                 on_turn: Callable[[TurnRecord], None] | None = None) -> None:
        self.config = config
        self.session_id = session_id
        self.tracer = TurnTracer(session_id, config.tracing, on_turn=on_turn)
        self.output: PlayoutOutput = session_output(session_id, config.playout.history_frames)
        self.user_audio = UserAudioQueue(config.egress.user_audio_queue_frames)
        mic = None if config.ingest.adapter == "scripted" else self.user_audio  # the scripted agent is its own user
        self.runner = Session(build_graph(config, self.tracer, mic, weights), config, session_id,
                              handle_signals=False)
        self.result: SessionResult | None = None
        self.done = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"session-{self.session_id}")

    async def _run(self) -> None:
        try:
            self.result = await self.runner.run()
        finally:
            self.tracer.close()
            self.output.close()
            self.done.set()

    async def stop(self, reason: str = "requested") -> SessionResult | None:
        """End the session and wait for it (idempotent)."""
        if self._task is None:
            return None
        self.runner.stop(reason)
        await self.done.wait()
        return self.result

    def media(self) -> SessionMedia:
        """What the egress server needs for this session's peer connection."""
        return SessionMedia(self.output, self.user_audio, on_turn=self.tracer.merge, close=self.stop)


def session_factory(config: PipelineConfig, weights: str | None = "packaged",
                    on_session: Callable[[LiveSession], Any] | None = None) -> SessionFactory:
    """An egress ``SessionFactory``: each new peer gets its own ``LiveSession`` (own trace file name
    when several sessions share a config: ``<stem>-<session>.jsonl`` after the first)."""
    started = 0

    async def factory(session_id: str) -> SessionMedia:
        nonlocal started
        session_config = copy.deepcopy(config)
        path = session_config.tracing.jsonl_path
        if path and started:
            stem, _, ext = path.rpartition(".")
            session_config.tracing.jsonl_path = f"{stem}-{session_id}.{ext}" if stem else f"{path}-{session_id}"
        started += 1
        session = LiveSession(session_config, session_id, weights)
        session.start()
        if on_session is not None:
            on_session(session)
        return session.media()

    return factory
