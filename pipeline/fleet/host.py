"""The session on its node: a Ray actor running one session and that session's own egress server.

The front door creates one ``SessionHost`` per session inside the session's placement group,
calls ``start`` (which reserves the session on the node's egress and returns its address and
token), forwards the page's offer to that address, awaits ``ended`` (it raises if the node or the
actor dies) and polls ``average_fps``. The average counts fresh frames only (frames playout
released from a chunk, not frames it held through an underrun) over the wall time since the
playout clock started: ``PlayoutStats.achieved_fps``, read from outside the session.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import os
import time
from typing import Any

import ray

from charstream.pipeline.config import PipelineConfig
from charstream.pipeline.runtime.layouts import apply_layout
from charstream.pipeline.runtime.process import MemoryTrimmer
from charstream.pipeline.serve import make_factory
from charstream.pipeline.web.server import EgressServer, Peer

FPS_SCAN_S = 0.25  # playout keeps 30 s of frame records: scanned well within that


class SessionHost:
    def __init__(self, config: PipelineConfig, source: str) -> None:
        self.config = config
        self.source = source
        self.server: EgressServer | None = None
        self.trimmer: MemoryTrimmer | None = None  # the actor's process owns the serving loop
        self.peer: Peer | None = None
        self._fresh_frames = 0
        self._scanned_to = 0
        self._scanner: asyncio.Task | None = None
        self._ended_at: float | None = None
        self._first_report: tuple[float, int] | None = None  # (when, count) of the page's first frame reports

    async def start(self, gpu_ids: list[str]) -> dict[str, Any]:
        """Start the node's egress with one reserved session; its processes see only ``gpu_ids``."""
        if gpu_ids:  # before anything touches CUDA: the session's ranks see their bundles' GPUs as cuda:0..
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
        config = apply_layout(copy.deepcopy(self.config), self.config.fleet.layout,
                                 gpus_available=len(gpu_ids) if gpu_ids else None)
        egress = dataclasses.replace(config.egress, host=ray.util.get_node_ip_address(), port=0, max_sessions=1)
        config = dataclasses.replace(config, egress=egress)
        self.server = EgressServer(egress, make_factory(self.source, config))
        url = await self.server.start()
        self.trimmer = MemoryTrimmer(egress.memory_trim_s)
        self.trimmer.start()
        session_id, token = self.server.create_session()
        self.peer = self.server.sessions[session_id]
        self._scanner = asyncio.create_task(self._scan_forever())
        return {"url": url, "session_id": session_id, "token": token,
                "node_id": ray.get_runtime_context().get_node_id()}

    async def ended(self) -> dict[str, Any]:
        """Returns when the session ends, however it ends: why, and its figures."""
        await self.peer.closed.wait()
        self._scanner.cancel()
        figures = self.figures()  # the clock stops with the session
        self._ended_at = time.monotonic()
        await self.trimmer.stop()
        await self.server.stop()
        return {"reason": self.peer.end_reason, **figures}

    def figures(self) -> dict[str, float | None]:
        """``played_s`` since the playout clock started, ``average_fps`` (None before it started) and
        ``presented_fps``: the frames the page reported presenting per second (held frames too)."""
        self._scan()
        output = self.peer.media.output if self.peer is not None and self.peer.media is not None else None
        if output is None or output.t0 is None:
            return {"played_s": 0.0, "average_fps": None, "presented_fps": None}
        now = self._ended_at or time.monotonic()
        played = max(now - output.t0, 0.0)
        presented = None
        if self._first_report is not None and now > self._first_report[0]:
            presented = (self.peer.timing.frames_reported - self._first_report[1]) / (now - self._first_report[0])
        return {"played_s": played, "average_fps": self._fresh_frames / played if played > 0 else None,
                "presented_fps": presented}

    async def stop(self, reason: str) -> None:
        """End the session from outside (the front door stopping); ``ended`` then returns."""
        await self.server.close_session(self.peer.session_id, reason)

    async def _scan_forever(self) -> None:
        while True:
            await asyncio.sleep(FPS_SCAN_S)
            self._scan()

    def _scan(self) -> None:
        output = self.peer.media.output if self.peer is not None and self.peer.media is not None else None
        if output is None or self._ended_at is not None:
            return
        for index in range(self._scanned_to, output.next_index):  # record() holds the last 30 s
            record = output.record(index)
            if record is not None and record.chunk is not None:
                self._fresh_frames += 1
        self._scanned_to = output.next_index
        timing = self.peer.timing
        if self._first_report is None and timing is not None and timing.frames_reported:
            self._first_report = (time.monotonic(), timing.frames_reported)
