"""The processes of ``charstream bench capacity``: server workers, client processes, and how they talk.

A **server worker** is one event loop with one ``EgressServer`` and the live sessions it serves
(``pipeline.session.session_factory``: each session the whole stage graph). A **client process**
is one event loop holding the aiortc clients (``EgressClient``) of many sessions: they receive and
decode the media and report presented frames, as a page does. Both are spawned by the bench
(``transport.supervisor``: they die with it) and answer its requests over one ZeroMQ socket (a
DEALER named after the process, connected to the bench's ROUTER on loopback), JSON both ways:

    worker:  open {count} -> {sessions: [[id, token]], url} · mark -> snapshot · stats -> snapshot + window
    client:  connect {sessions: [[url, id, token, delay_s]]} -> {failed} · mark / stats -> counts · hangup {sessions}
    both:    quit -> {} and the process ends

A snapshot holds cumulative counters per session with the process's own monotonic clock (the same
clock in every process of the host), so the bench takes differences over a window without the
request's own delay in them. ``mark`` starts a window: the event-loop lag samples and the diffusion
step times reported by the next ``stats`` are those since it.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
import threading
import time
from collections import defaultdict
from typing import TYPE_CHECKING, Any

import numpy as np
import zmq
import zmq.asyncio

from charstream.pipeline.config import PipelineConfig
from charstream.pipeline.runtime.loop_lag import LoopLag
from charstream.stages.playout.stats import UNDERRUN_CAUSES

if TYPE_CHECKING:
    from charstream.model.families.base import ModelFamily

CONNECTS_AT_ONCE = 4  # offers in flight per client process (each starts a session on its worker)


def thread_cpu() -> dict[str, float]:
    """CPU seconds of this process's threads by name, a pool's numbered threads added up (``decode_0``,
    ``decode_1``: ``decode``); threads Python did not start (torch's, a library's) as ``native``. A thread
    that has ended is no longer counted. Linux (``/proc``); elsewhere nothing."""
    names = {t.native_id: re.sub(r"([-_]\d+)+$", "", t.name) for t in threading.enumerate()}
    ticks = os.sysconf("SC_CLK_TCK")
    seconds: dict[str, float] = defaultdict(float)
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the command's name: state, ppid, ...
        except OSError:  # the thread ended meanwhile
            continue
        seconds[names.get(int(tid), "native")] += (int(fields[11]) + int(fields[12])) / ticks  # utime + stime
    return dict(seconds)


class Link:
    """This process's end of the bench's socket: requests in, replies out (JSON)."""

    def __init__(self, endpoint: str, name: str) -> None:
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, name.encode())
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.connect(endpoint)

    async def send(self, msg: dict[str, Any]) -> None:
        await self.sock.send(json.dumps(msg).encode())

    async def recv(self) -> dict[str, Any]:
        return json.loads(await self.sock.recv())

    def close(self) -> None:
        self.sock.close()
        self.ctx.term()


async def serve_requests(link: Link, name: str, handlers: dict[str, Any], stop: asyncio.Event) -> int | None:
    """Answer each request (``{"id", "cmd", ...}``) with ``{"id", "ok", ...}``, each in its own task,
    until ``quit`` (returns its id: the caller answers it once it has cleaned up) or ``stop``
    (returns None); a handler that raises answers ``{"ok": false, "error"}``."""
    tasks: set[asyncio.Task] = set()

    async def answer(request: dict[str, Any]) -> None:
        try:
            reply = {"ok": True, **(await handlers[request["cmd"]](request))}
        except Exception as e:  # the bench reports it; this process goes on
            reply = {"ok": False, "error": f"{name}: {request.get('cmd')}: {type(e).__name__}: {e}"}
        await link.send({"id": request["id"], **reply})

    receive = asyncio.create_task(link.recv())
    stopped = asyncio.create_task(stop.wait())
    try:
        while True:
            done, _ = await asyncio.wait({receive, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if stopped in done:
                return None
            request = receive.result()
            if request.get("cmd") == "quit":
                await asyncio.gather(*tasks, return_exceptions=True)
                return request["id"]
            task = asyncio.create_task(answer(request))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            receive = asyncio.create_task(link.recv())
    finally:
        receive.cancel()
        stopped.cancel()
        for task in tasks:
            task.cancel()
        await asyncio.gather(receive, stopped, *tasks, return_exceptions=True)


def _stop_on_sigterm(stop: asyncio.Event) -> None:
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)


# -- the server worker ---------------------------------------------------------------------------------


def run_worker(endpoint: str, name: str, config: PipelineConfig, weights: str | None, log_level: str = "error",
               family: ModelFamily | None = None, portrait: np.ndarray | None = None) -> dict[str, Any]:
    """A server worker's process (a ``Supervisor`` target): returns its report. ``family`` and ``portrait``:
    the sessions' model, when not the one ``config.preset`` names at its size, and the face it animates."""
    from charstream.logs import configure_logging

    configure_logging(log_level)
    try:
        asyncio.run(_worker(endpoint, name, config, weights, family, portrait))
    except Exception as e:
        return {"error": f"{name}: {type(e).__name__}: {e}"}
    return {}


def device_info(config: PipelineConfig, weights: str | None) -> dict[str, Any]:
    """torch's version, the weights and the sessions' device, initialised now (not in the first session's setup)."""
    if config.hosting == "engine":  # the model stages, and CUDA, are the engine's
        return {"device": f"engine at {config.engine_endpoint}"}
    import torch

    from charstream.model.weights import resolve_weights

    device = config.diffusion.device
    info = {"torch": torch.__version__, "device": device, "weights": resolve_weights(config.preset, weights) or "random"}
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError(f"sessions are placed on {device}, but torch sees no CUDA device")
        index = torch.device(device).index or 0
        torch.cuda.init()
        info["gpu"] = torch.cuda.get_device_name(index)
    return info


class Worker:
    def __init__(self, config: PipelineConfig, weights: str | None, family: ModelFamily | None = None,
                 portrait: np.ndarray | None = None) -> None:
        from charstream.pipeline.runtime.process import MemoryTrimmer
        from charstream.pipeline.session import session_factory
        from charstream.pipeline.web.server import EgressServer

        self.sessions: dict[str, Any] = {}  # every LiveSession started here, ended ones too
        self.factory = session_factory(config, weights, on_session=self._started, portrait=portrait, family=family)
        self.server = EgressServer(config.egress, self.factory)
        self.trimmer = MemoryTrimmer(config.egress.memory_trim_s)  # this process owns the serving loop
        self.lag = LoopLag()
        self._steps_from: dict[str, int] = {}  # per session: diffusion steps counted before the window

    def _started(self, session) -> None:
        self.sessions[session.session_id] = session

    async def open(self, request: dict[str, Any]) -> dict[str, Any]:
        return {"url": self.server.url, "sessions": [list(self.server.create_session()) for _ in range(request["count"])]}

    def _session(self, session_id: str, session) -> dict[str, Any]:
        stages = session.stages
        playout = stages.get("playout")
        stats = playout.stats if playout is not None else None
        peer = self.server.sessions.get(session_id)
        result = session.result
        data = {
            "fresh_frames": stats.fresh_frames if stats else 0,
            "frames_released": stats.frames_released if stats else 0,
            "underruns": stats.underruns if stats else 0,
            **{f"{cause}_underruns": stats.by_cause[cause].count if stats else 0 for cause in UNDERRUN_CAUSES},
            "late_ticks": stats.late_ticks if stats else 0,
            "skipped_video_frames": peer.video.skipped_frames if peer is not None and peer.video is not None else None,
            "ended": None if not session.done.is_set() else (result.error or result.ended_by if result else "failed"),
            # (wall time of the first speaking frame, pipeline s, total s or None) of every exported turn
            "turns": [[r.stamps["playout_first_speaking_frame"],
                       r.stamps["playout_first_speaking_frame"] - r.stamps["agent_first_audio"],
                       r.stamps["client_first_speaking_frame"] - r.stamps["user_speech_end"]
                       if {"client_first_speaking_frame", "user_speech_end"} <= r.stamps.keys() else None]
                      for r in session.tracer.records
                      if {"playout_first_speaking_frame", "agent_first_audio"} <= r.stamps.keys()],
        }
        return data

    def snapshot(self) -> dict[str, Any]:
        # the process's cross-session batchers (batch_sessions > 1): forwards run, session steps / chunks served
        batchers = {"diffusion": self.factory.batcher, "decode": self.factory.decode_batcher,
                    "encode": self.factory.encode_batcher}
        return {"now": time.monotonic(), "sessions": {sid: self._session(sid, s) for sid, s in self.sessions.items()},
                "batchers": {kind: {"forwards": b.stats.forwards, "served": b.stats.steps}
                             for kind, b in batchers.items() if b is not None},
                "threads": thread_cpu()}

    async def mark(self, request: dict[str, Any]) -> dict[str, Any]:
        self.lag.samples.clear()
        for sid, session in self.sessions.items():
            diffusion = session.stages.get("diffusion")  # None when it runs in a process of its own
            self._steps_from[sid] = len(diffusion.stats.step_s) if diffusion is not None else 0
        return self.snapshot()

    async def stats(self, request: dict[str, Any]) -> dict[str, Any]:
        snapshot = self.snapshot()
        steps: list[float] = []
        for sid, session in self.sessions.items():
            diffusion = session.stages.get("diffusion")
            if diffusion is not None:
                steps.extend(list(diffusion.stats.step_s)[self._steps_from.get(sid, 0):])
        snapshot["step_ms"] = [round(s * 1e3, 3) for s in steps]  # the window's diffusion steps (wall, thread hop included)
        snapshot["loop_lag"] = self.lag.summary()
        snapshot["live_sessions"] = len(self.factory.sessions)
        torch = sys.modules.get("torch")  # imported by the stages or the VAD, or not at all
        snapshot["cuda_context"] = bool(torch is not None and torch.cuda.is_initialized())  # engine hosting: False
        return snapshot


async def _worker(endpoint: str, name: str, config: PipelineConfig, weights: str | None,
                  family: ModelFamily | None, portrait: np.ndarray | None) -> None:
    link = Link(endpoint, name)
    stop = asyncio.Event()
    _stop_on_sigterm(stop)
    worker, quit_id = None, None
    try:
        info = await asyncio.to_thread(device_info, config, weights)
        worker = Worker(config, weights, family, portrait)
        url = await worker.server.start()
        worker.trimmer.start()
        worker.lag.start()
        await link.send({"id": None, "hello": name, "pid": os.getpid(), "url": url, **info})
        quit_id = await serve_requests(link, name, {"open": worker.open, "mark": worker.mark, "stats": worker.stats},
                                       stop)
    finally:
        try:
            if worker is not None:
                await worker.lag.stop()
                await worker.trimmer.stop()
                await worker.server.stop()  # closes every session: their stages stop, their processes end
                for session in list(worker.sessions.values()):
                    await session.stop("bench finished")
        finally:
            await _answer_quit(link, quit_id)


async def _answer_quit(link: Link, quit_id: int | None) -> None:
    """Tell the bench this process has cleaned up (if it asked us to quit), and close the socket."""
    try:
        if quit_id is not None:
            await link.send({"id": quit_id, "ok": True})
    finally:
        link.close()


# -- the client process --------------------------------------------------------------------------------


def run_clients(endpoint: str, name: str, connect_timeout_s: float, nice: int) -> dict[str, Any]:
    """A client process (a ``Supervisor`` target) at niceness ``nice``: returns its report."""
    from charstream.logs import configure_logging

    configure_logging("error")
    os.nice(nice)
    try:
        asyncio.run(_clients(endpoint, name, connect_timeout_s))
    except Exception as e:
        return {"error": f"{name}: {type(e).__name__}: {e}"}
    return {}


class Clients:
    def __init__(self, connect_timeout_s: float) -> None:
        self.connect_timeout_s = connect_timeout_s
        self.clients: dict[str, Any] = {}
        self.connected_at: dict[str, float] = {}  # session -> when its connection was up (monotonic, host-wide)
        self.lag = LoopLag()
        self._slots = asyncio.Semaphore(CONNECTS_AT_ONCE)

    async def _connect(self, url: str, session_id: str, token: str, delay_s: float) -> str | None:
        from charstream.pipeline.web.client import EgressClient

        client = self.clients[session_id] = EgressClient()
        await asyncio.sleep(delay_s)  # the bench's --spread-s: this session's start within the count's
        async with self._slots:
            try:
                await asyncio.wait_for(client.connect(url, token, timeout=self.connect_timeout_s),
                                       self.connect_timeout_s + 5)
            except Exception as e:
                return f"{type(e).__name__}: {e}"
        self.connected_at[session_id] = time.monotonic()
        return None

    async def connect(self, request: dict[str, Any]) -> dict[str, Any]:
        sessions = request["sessions"]
        errors = await asyncio.gather(*(self._connect(*s) for s in sessions))
        return {"failed": {s[1]: e for s, e in zip(sessions, errors, strict=True) if e is not None}}

    async def mark(self, request: dict[str, Any]) -> dict[str, Any]:
        self.lag.samples.clear()
        return await self.stats(request)

    async def stats(self, request: dict[str, Any]) -> dict[str, Any]:
        return {"now": time.monotonic(), "loop_lag": self.lag.summary(),
                "sessions": {sid: {"video_frames": c.video_frames, "audio_samples": c.audio_samples, "ended": c.ended,
                                   "connected_at": self.connected_at.get(sid)}
                             for sid, c in self.clients.items()}}

    async def hangup(self, request: dict[str, Any]) -> dict[str, Any]:
        """Close the clients of these sessions (their servers end the sessions)."""
        clients = [self.clients.pop(sid) for sid in request["sessions"] if sid in self.clients]
        await asyncio.gather(*(asyncio.wait_for(c.close(), 10) for c in clients), return_exceptions=True)
        return {"closed": len(clients)}

    async def close(self) -> None:
        await self.hangup({"sessions": list(self.clients)})


async def _clients(endpoint: str, name: str, connect_timeout_s: float) -> None:
    link = Link(endpoint, name)
    stop = asyncio.Event()
    _stop_on_sigterm(stop)
    clients, quit_id = Clients(connect_timeout_s), None
    try:
        clients.lag.start()
        await link.send({"id": None, "hello": name, "pid": os.getpid(), "nice": os.nice(0)})
        quit_id = await serve_requests(link, name, {"connect": clients.connect, "mark": clients.mark,
                                                    "stats": clients.stats, "hangup": clients.hangup}, stop)
    finally:
        try:
            await clients.lag.stop()
            await clients.close()
        finally:
            await _answer_quit(link, quit_id)
