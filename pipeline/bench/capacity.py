"""``charstream bench capacity``: how many concurrent live sessions one host serves, each at 24 fps.

    charstream bench capacity --gpus 1 --sessions 8 16 32 48 --workers 16 --clients 4 --out capacity.json
    charstream bench capacity --sessions 1 2 --workers 2 --clients 1 --hold 10     (CPU)
    charstream bench capacity --gpus 1 --engines 1 --batch-sessions 1 48 --sessions 32 48 --workers 16 --clients 4
    charstream bench capacity --preset flashhead-lite --weights DIR --portrait face.png --gpus 1 --workers 4 \
        --clients 4 --batch-sessions 4 --sessions 8 16

Every session is the whole stage graph (``pipeline.session``): the built-in scripted agent
(espeak-ng voices, silero-vad on its simulated user's microphone; its recogniser off unless
``--recognizer``) → ingest → conditioning → diffusion → decode → playout over ZeroMQ → WebRTC
egress → a real aiortc client that receives and decodes audio and video and reports presented
frames on the data channel, as a page does. Sessions are spread over ``--workers`` server
processes (each one event loop with its own ``EgressServer``, its sessions and, ``--hosting
inproc``, their model stages in its threads, sharing the GPU); their clients over ``--clients``
processes of their own, so the bench measures the server, not its clients
(``pipeline/bench/capacity_worker.py``). With ``--engines K`` the bench first starts K model engines
(``pipeline/runtime/engine.py``) and every session's model stages run in one of them (``hosting
engine``: worker ``i``'s sessions in engine ``i mod K``, so sessions, added to the workers in
turn, fill the engines in turn; one CUDA context per engine, ``--batch-sessions`` batching
inside each engine). Everything binds loopback.

The ladder: for each count of ``--sessions``, it adds sessions up to that count (the earlier ones
keep playing; all at once, or evenly over ``--spread-s`` seconds so that their scripted turns do not
start together), waits until every new client has video, warms up ``--warmup`` s, then holds
``--hold`` s and measures over that window, per session: playout fps (fresh frames playout released
per second: 24 when nothing stalled), the frames the client received per second, underruns, late
clock ticks, frames the video track skipped (a slow encoder) and the pipeline latency of the turns
whose first speaking frame fell in the window (agent's first audio → first speaking frame); and
where the host stands: GPU busy (``nvidia-smi`` utilization, sampled each second), CPU of every
process (cores used, its main thread, which runs the event loop, and for a server by thread name:
its stages' workers, batchers, egress) and the machine, and each
event loop's lag; per engine also the sessions it hosts and the sessions per batched forward, and
which processes hold a CUDA context. A session holds the rate when both of its fps are at least
``--min-fps`` less one frame over the window (the window's ends fall between frames). The ladder stops at the first count
where a session does not, and says which resources were saturated there (≥ 90%, or an event loop
lagging more than a frame). ``--batch-sessions 1 8`` runs the whole ladder once per value, on fresh
processes (``diffusion``, ``decode`` and ``conditioning.batch_sessions``, as ``serve --batch-sessions``:
the most sessions of a process one batched forward serves; 1 is off). ``--budget-s`` bounds one ladder's wall time: a count that would not fit is not
started. The JSON (``--out``) is rewritten after each count, so a run cut short keeps what it measured.

A FlashHead preset (``--portrait`` the face every session animates; its weights folder or ``random``)
holds its own rate (25 fps); its sessions share their worker's model (``inproc``), and with
``--batch-sessions`` their chunks are batched. ``--blocks`` / ``--size`` / ``--vae-width`` make it small
enough to check the bench on a CPU.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import math
import os
import platform
import shutil
import signal
import statistics
import subprocess
import tempfile
import threading
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil
import zmq
import zmq.asyncio
from tqdm import tqdm

from charstream.logs import configure_logging
from charstream.pipeline import arguments
from charstream.pipeline.bench.capacity_worker import run_clients, run_worker
from charstream.pipeline.bench.output import commit_id, emit_report, percentiles, text_table
from charstream.pipeline.config import PipelineConfig
from charstream.pipeline.runtime.engine import check_engine_config, run_engine
from charstream.pipeline.runtime.engine_link import EngineError, engine_call
from charstream.stages.config import AGENT_PACES, IngestConfig
from charstream.stages.playout.stats import UNDERRUN_CAUSES
from charstream.timeline import CHARACTERS
from charstream.transport.supervisor import Supervisor, describe_exit

if TYPE_CHECKING:
    from charstream.model.families.base import ModelFamily

CAUSE_KEYS = tuple(f"{cause}_underruns" for cause in UNDERRUN_CAUSES)  # per session and level, beside the total

SATURATED = 0.9  # a resource this busy (of its whole) counts as saturated
STEAL_NOTED = 0.05  # a VM whose hypervisor takes this share of its cores: named beside what saturated
FRAME_S = 1 / CHARACTERS.fps
MIN_TURN_S = 6.0  # a scripted turn (user line, think, reply, gap) takes longer than this
GPU_SAMPLE_S = 1.0
CALL_TIMEOUT_S = 30.0  # a request to a worker or client process (connects take their own limit)
QUIT_TIMEOUT_S = 60.0  # a process's cleanup (its sessions stop) before it is terminated
EXIT_GRACE_S = 30.0  # from its answer to quit (cleaned up) to its exit: a loaded host takes seconds to end a torch process


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sessions", type=int, nargs="+", default=[8, 16, 32, 48],
                        help="concurrent session counts, in order (default: 8 16 32 48)")
    parser.add_argument("--preset", default="tiny", help="model preset (default: tiny)")
    parser.add_argument("--weights", default="packaged",
                        help="'packaged' (the trained weights shipped), 'random', or a FlashHead weights folder")
    parser.add_argument("--portrait", help="the face a FlashHead preset animates (every session's)")
    arguments.add_size_arguments(parser)
    arguments.renamed(parser, "--placement", "--hosting")
    parser.add_argument("--gpus", metavar="LAYOUT", default=None,
                        help="GPU layout of every session (pipeline/runtime/layouts.py), e.g. 1; default: CPU")
    parser.add_argument("--hosting", choices=["inproc", "processes", "engine"], default=None,
                        help="inproc (default): a session's model stages run in its worker's threads (what "
                             "cross-session batching needs); processes: in processes of their own, as `demo --gpus`; "
                             "engine (the default with --engines): in the engines the bench starts")
    parser.add_argument("--engines", type=int, default=0,
                        help="model engine processes (pipeline/runtime/engine.py) started before the workers, hosting "
                             "every session's model stages (default 0: none)")
    parser.add_argument("--workers", type=int, default=2, help="server processes, each one event loop (default 2)")
    parser.add_argument("--clients", type=int, default=1, help="client processes (default 1)")
    parser.add_argument("--client-nice", type=int, default=10,
                        help="the client processes' niceness (default 10; 0: the servers' own): they stand in for "
                             "browsers on other machines, so the servers come first for this host's cores")
    parser.add_argument("--batch-sessions", type=int, nargs="+", default=[1],
                        help="one ladder per value: diffusion, decode and conditioning batch_sessions (1: no cross-session batching)")
    parser.add_argument("--hold", type=float, default=30.0, help="measured seconds at each count (default 30)")
    parser.add_argument("--warmup", type=float, default=5.0, help="seconds between a count's start and its window")
    parser.add_argument("--min-fps", type=float, default=None,
                        help="the rate every session must hold (default: the model's, 24 or 25)")
    parser.add_argument("--spread-s", type=float, default=0.0,
                        help="start a count's new sessions evenly over this many seconds, so that their scripted "
                             "turns are out of phase as real users' are (default 0: all at once, every session's "
                             "turn starting within about a second: the turn-start path's worst case)")
    parser.add_argument("--start-timeout", type=float, default=120.0,
                        help="seconds for processes to start and for new sessions' first frames (default 120)")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="wall-time budget of one ladder: a count that would not fit is not started")
    parser.add_argument("--threads", type=int, default=1, help="CPU sessions: intra-op threads of diffusion and decode")
    parser.add_argument("--log-level", default="error",
                        help="the server workers' log lines (JSON on stderr) at this level; info names each "
                             "turn's speech placement and every underrun")
    parser.add_argument("--agent-pace", choices=AGENT_PACES, default=IngestConfig().agent_pace,
                        help="how the scripted agent streams its reply: in real time, or as synthesised (ahead of "
                             "real time, as TTS services push audio); default: ingest's")
    parser.add_argument("--recognizer", action="store_true",
                        help="the scripted user's speech also goes through the built-in recogniser (pocketsphinx)")
    parser.add_argument("--out", default="bench-capacity.json", help="write the JSON report here")
    parser.add_argument("--json", action="store_true", help="print the report as JSON (the table goes to stderr)")


def hosting(args: argparse.Namespace) -> str:
    """``--hosting``, or its default: engine with ``--engines``, else inproc."""
    engines = getattr(args, "engines", 0)
    chosen = args.hosting or ("engine" if engines else "inproc")
    if (chosen == "engine") != (engines > 0):
        raise ValueError("hosting engine and --engines K >= 1 go together")
    return chosen


def per_process(args: argparse.Namespace) -> int:
    """The most sessions one batcher serves: per worker, or per engine with ``--engines`` (the warm-up
    puts one session per worker in the engines at once)."""
    if getattr(args, "engines", 0):
        return math.ceil(max(max(args.sessions), args.workers) / args.engines)
    return math.ceil(max(args.sessions) / args.workers)


def engine_endpoint(folder: str, index: int) -> str:
    return f"ipc://{folder}/engine-{index}.sock"


def session_config(args: argparse.Namespace, batch_sessions: int) -> PipelineConfig:
    """Every session's config: the preset on the layout's devices, the scripted agent talking all along."""
    from charstream.stages.agents.scripted import DEFAULT_SCRIPT

    config = PipelineConfig(preset=args.preset)
    if args.gpus:
        from charstream.pipeline.runtime.layouts import apply_layout

        config = apply_layout(config, args.gpus)  # the workers check the devices exist
    config.hosting = hosting(args)
    if config.diffusion.device == "cpu":
        config.diffusion.threads = args.threads
    if config.decode.device == "cpu":
        config.decode.threads = args.threads
    if batch_sessions < 1:
        raise ValueError(f"--batch-sessions must be >= 1 (1 = off), got {batch_sessions}")
    config.diffusion.batch_sessions = config.decode.batch_sessions = batch_sessions  # as serve --batch-sessions
    config.conditioning.batch_sessions = batch_sessions
    longest = max(args.sessions)
    run_s = args.start_timeout + len(args.sessions) * (args.warmup + args.hold + args.start_timeout)
    repeats = max(1, math.ceil(run_s / (len(DEFAULT_SCRIPT) * MIN_TURN_S)))  # every text is synthesised once
    config.ingest.adapter = "scripted"
    config.ingest.scripted_recognizer = args.recognizer
    config.ingest.agent_pace = args.agent_pace
    config.ingest.script = [{"user": line.user, "agent": line.agent} for line in DEFAULT_SCRIPT] * repeats
    config.egress.port = 0
    config.egress.max_sessions = longest
    config.egress.offer_timeout_s = args.start_timeout + CALL_TIMEOUT_S
    config.tracing.otel_exporter = "none"
    return config


class Processes:
    """The worker and client processes and the ROUTER socket they answer on."""

    def __init__(self) -> None:
        self.supervisor = Supervisor()
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a process that is gone raises
        self.sock.setsockopt(zmq.LINGER, 0)
        port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.hello: dict[str, dict[str, Any]] = {}
        self._pending: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self._reader: asyncio.Task | None = None
        self._hello_event = asyncio.Event()

    def launch(self, name: str, target, *args: Any) -> None:
        self.supervisor.launch(name, target, *args)

    async def _read(self) -> None:
        while True:
            identity, payload = await self.sock.recv_multipart()
            msg = json.loads(payload)
            if msg.get("id") is None:
                self.hello[identity.decode()] = msg
                self._hello_event.set()
            elif (future := self._pending.pop(msg["id"], None)) is not None and not future.done():
                future.set_result(msg)

    def start_reading(self) -> None:
        self._reader = asyncio.create_task(self._read(), name="capacity-replies")

    def _dead(self) -> list[str]:
        return [f"{c.name} {describe_exit(c.process.exitcode)}" + (f": {c.report()['error']}"
                                                                    if (c.report() or {}).get("error") else "")
                for c in self.supervisor.children.values() if not c.process.is_alive()]

    async def wait_hello(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while len(self.hello) < len(self.supervisor.children):
            if dead := self._dead():
                raise RuntimeError(f"a process ended before it was ready: {'; '.join(dead)}")
            if time.monotonic() > deadline:
                missing = sorted(set(self.supervisor.children) - set(self.hello))
                raise TimeoutError(f"not ready after {timeout:.0f} s: {', '.join(missing)}")
            self._hello_event.clear()
            try:
                await asyncio.wait_for(self._hello_event.wait(), 0.5)
            except TimeoutError:
                pass

    async def call(self, name: str, cmd: str, timeout: float = CALL_TIMEOUT_S, **fields: Any) -> dict[str, Any]:
        request_id = next(self._ids)
        future = self._pending[request_id] = asyncio.get_running_loop().create_future()
        child = self.supervisor.children[name]
        deadline = time.monotonic() + timeout
        try:
            await self.sock.send_multipart([name.encode(), json.dumps({"id": request_id, "cmd": cmd, **fields}).encode()])
            while not future.done() and child.process.is_alive() and time.monotonic() < deadline:
                await asyncio.wait([future], timeout=min(0.5, max(0.0, deadline - time.monotonic())))
        except zmq.ZMQError as e:
            state = "running" if child.process.is_alive() else describe_exit(child.process.exitcode)
            raise RuntimeError(f"{name}: {cmd!r} not sent ({state}): {e}") from None
        finally:
            self._pending.pop(request_id, None)
        if not future.done():
            future.cancel()
            state = "running" if child.process.is_alive() else describe_exit(child.process.exitcode)
            raise RuntimeError(f"{name} did not answer {cmd!r} ({state}, waited {timeout - (deadline - time.monotonic()):.1f} s)")
        reply = future.result()
        if not reply["ok"]:
            raise RuntimeError(reply["error"])
        return reply

    async def close(self) -> dict[str, Any]:
        """Ask every process to quit (its sessions stop cleanly), then stop what is left; their reports."""
        alive = [name for name, c in self.supervisor.children.items() if c.process.is_alive() and name in self.hello]
        await asyncio.gather(*(self.call(name, "quit", QUIT_TIMEOUT_S) for name in alive), return_exceptions=True)
        await self.supervisor.stop_all(grace_s=EXIT_GRACE_S)
        self.supervisor.kill_all()
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        self.sock.close()
        self.ctx.term()
        return {name: {"exit": describe_exit(c.process.exitcode), **(c.report() or {})}
                for name, c in self.supervisor.children.items()}


class Engines:
    """The model engines (``--engines``): started before the workers, asked for ``status`` on their own
    sockets (msgpack, ``pipeline/runtime/engine_link.py``), stopped with SIGTERM after the workers quit."""

    def __init__(self, count: int, config: PipelineConfig, weights: str | None, folder: str, max_sessions: int,
                 family: ModelFamily | None = None) -> None:
        self.supervisor = Supervisor()
        self.endpoints = {f"engine-{j}": engine_endpoint(folder, j) for j in range(count)}
        self.pids: dict[str, int] = {}
        self.devices: dict[str, dict[str, str]] = {}  # torch's version, the device and the GPU's name
        for name, endpoint in self.endpoints.items():
            self.supervisor.launch(name, run_engine, config, weights, endpoint, max_sessions, "warning", family)

    async def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for name, endpoint in self.endpoints.items():
            child = self.supervisor.children[name]
            while name not in self.pids:
                if not child.process.is_alive():
                    why = (child.report() or {}).get("error", "")
                    raise RuntimeError(f"{name} ended before it was ready: {describe_exit(child.process.exitcode)} {why}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{name} not ready after {timeout:.0f} s")
                try:
                    status = await engine_call(endpoint, {"cmd": "status"}, timeout=1.0)
                except EngineError:
                    continue
                self.pids[name], self.devices[name] = status["pid"], status["device"]

    async def call(self, name: str, mark: bool) -> dict[str, Any]:
        return await engine_call(self.endpoints[name], {"cmd": "status", "mark": mark}, CALL_TIMEOUT_S)

    async def close(self) -> dict[str, Any]:
        for child in self.supervisor.children.values():
            if child.process.is_alive():
                os.kill(child.pid, signal.SIGTERM)  # the engine ends what it still hosts and exits
        await self.supervisor.stop_all(grace_s=EXIT_GRACE_S)
        self.supervisor.kill_all()
        return {name: {"exit": describe_exit(c.process.exitcode), **(c.report() or {})}
                for name, c in self.supervisor.children.items()}


# -- measurement of the host ---------------------------------------------------------------------------


def process_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of a process (its children, e.g. stage processes, separately) and of its main thread."""
    try:
        process = psutil.Process(pid)
        times = process.cpu_times()
        main = next((t.user_time + t.system_time for t in process.threads() if t.id == pid), 0.0)
        children = 0.0
        for child in process.children(recursive=True):
            try:
                child_times = child.cpu_times()
                children += child_times.user + child_times.system
            except psutil.Error:
                pass
        return {"process": times.user + times.system, "main_thread": main, "children": children}
    except psutil.Error:
        return {"process": 0.0, "main_thread": 0.0, "children": 0.0}


def host_cpu() -> tuple[float, float, float]:
    """(busy, steal, total) CPU seconds of the whole machine, every core. Steal (Linux, in a VM) is
    time the hypervisor ran something else while this machine's cores wanted to run: counted busy
    here, it is what our processes did not get."""
    times = psutil.cpu_times()
    idle = times.idle + getattr(times, "iowait", 0.0)
    total = sum(times)
    return total - idle, getattr(times, "steal", 0.0), total


class GpuSampler:
    """``nvidia-smi`` utilization (the share of time a kernel ran) and memory, sampled each second in a thread."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: str | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="gpu-sampler", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(GPU_SAMPLE_S):
            try:
                out = subprocess.run(["nvidia-smi", "--query-gpu=utilization.gpu,memory.used",
                                      "--format=csv,noheader,nounits", "-i", "0"],
                                     capture_output=True, text=True, timeout=5, check=True).stdout
                util, memory = (float(x) for x in out.strip().splitlines()[0].split(","))
                self.samples.append((util, memory))
            except (OSError, subprocess.SubprocessError, ValueError, IndexError) as e:
                self.error = f"{type(e).__name__}: {e}"

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if not self.samples:
            return {"samples": 0, "error": self.error}
        util = [u for u, _ in self.samples]
        return {"samples": len(util), "util_mean": round(statistics.fmean(util), 1), "util_max": max(util),
                "memory_max_mib": max(m for _, m in self.samples), "error": self.error,
                "context_pids": compute_pids()}


def compute_pids() -> list[int] | None:
    """The pids of the processes holding a CUDA context on GPU 0 now (``nvidia-smi``; None if it cannot tell)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader", "-i", "0"],
                             capture_output=True, text=True, timeout=5, check=True).stdout
        return sorted(int(line) for line in out.split())
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


# -- the ladder ----------------------------------------------------------------------------------------


@dataclasses.dataclass
class Placed:
    session_id: str
    worker: str
    client: str
    engine: str | None = None  # the engine hosting its model stages (--engines)


def engine_of(worker: int, engines: int) -> str | None:
    """The engine that hosts worker ``worker``'s sessions' model stages (None without engines)."""
    return f"engine-{worker % engines}" if engines else None


class Ladder:
    def __init__(self, args: argparse.Namespace, config: PipelineConfig, procs: Processes,
                 engines: Engines | None = None) -> None:
        self.args, self.config, self.procs, self.engines = args, config, procs, engines
        self.workers = [f"worker-{i}" for i in range(args.workers)]
        self.engine_of = {w: engine_of(i, len(engines.endpoints) if engines else 0) for i, w in enumerate(self.workers)}
        self.clients = [f"client-{i}" for i in range(args.clients)]
        self.placed: list[Placed] = []
        self.failed: dict[str, str] = {}  # session -> why it did not start
        self.gpu = bool(args.gpus) and shutil.which("nvidia-smi") is not None

    async def _start(self, per_worker: dict[str, int], placed: list[Placed], failed: dict[str, str],
                     spread_s: float = 0.0) -> None:
        """Open ``per_worker`` sessions on each worker, connect a client to each (the least loaded client
        process; the k-th of n after ``k * spread_s / n`` s) and wait for every one's first video frame;
        appends to ``placed``, and to ``failed`` why not."""
        opened = await asyncio.gather(*(self.procs.call(w, "open", count=k) for w, k in per_worker.items()))
        new: dict[str, list[list[Any]]] = {}
        clients = {c: sum(p.client == c for p in placed) for c in self.clients}
        # Round-robin over the workers, so that sessions starting one after the other are on different ones.
        by_worker = [[(worker, reply["url"], *session) for session in reply["sessions"]]
                     for worker, reply in zip(per_worker, opened, strict=True)]
        order = [s for batch in itertools.zip_longest(*by_worker) for s in batch if s is not None]
        for index, (worker, url, session_id, token) in enumerate(order):
            client = min(self.clients, key=lambda c: clients[c])
            clients[client] += 1
            placed.append(Placed(session_id, worker, client, self.engine_of[worker]))
            new.setdefault(client, []).append([url, session_id, token, spread_s * index / len(order)])
        timeout, started = self.args.start_timeout + spread_s, time.monotonic()
        replies = await asyncio.gather(*(self.procs.call(c, "connect", timeout + CALL_TIMEOUT_S, sessions=s)
                                         for c, s in new.items()))
        for reply in replies:
            failed.update(reply["failed"])
        waiting = {entry[1] for sessions in new.values() for entry in sessions} - set(failed)
        while waiting and time.monotonic() - started < timeout:
            await asyncio.sleep(0.5)
            for client in new:
                for sid, got in (await self.procs.call(client, "stats"))["sessions"].items():
                    if sid in waiting and (got["video_frames"] > 0 or got["ended"] is not None):
                        waiting.discard(sid)
                        if got["video_frames"] == 0:
                            failed[sid] = f"ended before its first frame: {got['ended']}"
        for sid in waiting:
            failed[sid] = f"no video frame within {timeout:.0f} s"

    async def warm_up(self) -> float:
        """One session per worker, played until its first frame and hung up: the first session of a
        process pays for lazy imports, kernel compiles and CUDA's first use, which the counts measured
        should not. Returns the seconds it took."""
        started = time.monotonic()
        placed: list[Placed] = []
        failed: dict[str, str] = {}
        await self._start(dict.fromkeys(self.workers, 1), placed, failed)
        if failed:
            raise RuntimeError("warm-up sessions failed: " + "; ".join(f"{s}: {why}" for s, why in failed.items()))
        await asyncio.gather(*(self.procs.call(c, "hangup", sessions=[p.session_id for p in placed if p.client == c])
                               for c in self.clients))
        while sum([(await self.procs.call(w, "stats"))["live_sessions"] for w in self.workers]) + sum(
                [(await self.engines.call(e, False))["hosted"] for e in (self.engines.endpoints if self.engines else ())]):
            if time.monotonic() - started > 2 * self.args.start_timeout:
                raise TimeoutError("warm-up sessions did not end after their clients hung up (or their engines kept them)")
            await asyncio.sleep(0.5)
        return time.monotonic() - started

    async def add(self, count: int) -> float:
        """Start ``count`` more sessions, spread over the workers, and wait for their first frames;
        returns the seconds it took."""
        started = time.monotonic()
        per_worker: dict[str, int] = {}
        loads = {w: sum(p.worker == w for p in self.placed) for w in self.workers}
        for _ in range(count):
            worker = min(self.workers, key=lambda w: loads[w])
            loads[worker] += 1
            per_worker[worker] = per_worker.get(worker, 0) + 1
        await self._start(per_worker, self.placed, self.failed, self.args.spread_s)
        return time.monotonic() - started

    async def snapshot(self, cmd: str) -> dict[str, Any]:
        """Every process's counters; one that fails to answer (it died) is left out, its error kept."""
        engines = list(self.engines.endpoints) if self.engines else []
        names = self.workers + self.clients + engines
        replies = await asyncio.gather(*(self.procs.call(n, cmd) for n in self.workers + self.clients),
                                       *(self.engines.call(n, cmd == "mark") for n in engines), return_exceptions=True)
        pids = {n: self.procs.hello[n]["pid"] for n in self.workers + self.clients} | (self.engines.pids if engines else {})
        return {"wall": time.time(), "now": time.monotonic(),
                "replies": {n: r for n, r in zip(names, replies, strict=True) if not isinstance(r, BaseException)},
                "errors": {n: str(r) for n, r in zip(names, replies, strict=True) if isinstance(r, BaseException)},
                "cpu": {n: process_cpu(pid) for n, pid in pids.items()}, "bench_cpu": process_cpu(os.getpid()), "pids": pids,
                "host": host_cpu()}

    async def level(self, count: int, progress: tqdm) -> dict[str, Any]:
        added_from = len(self.placed)
        start_s = await self.add(count - added_from)
        progress.set_description_str(f"{count} sessions: warm-up")
        await asyncio.sleep(self.args.warmup)
        sampler = GpuSampler() if self.gpu else None
        if sampler is not None:
            sampler.start()
        first = await self.snapshot("mark")
        progress.set_description_str(f"{count} sessions: hold")
        progress.reset(total=round(self.args.hold))
        while (elapsed := time.monotonic() - first["now"]) < self.args.hold:
            await asyncio.sleep(min(1.0, self.args.hold - elapsed))
            progress.n = min(round(time.monotonic() - first["now"]), progress.total)
            busy = host_cpu()
            share = (busy[0] - first["host"][0]) / max(1e-9, busy[2] - first["host"][2])
            gpu = f" · GPU {sampler.samples[-1][0]:.0f}%" if sampler is not None and sampler.samples else ""
            progress.set_postfix_str(f"host CPU {100 * share:.0f}%{gpu}", refresh=True)
        last = await self.snapshot("stats")
        gpu = sampler.stop() if sampler is not None else None
        return {"added_from": added_from, **summarise_level(count, added_from, start_s, first, last, self.placed, self.failed, gpu,
                                                            self.args)}


def _delta(a: dict[str, float], b: dict[str, float]) -> dict[str, float]:
    return {k: b[k] - a[k] for k in a}


def thread_cores(before: dict[str, float], after: dict[str, float], window: float) -> dict[str, float]:
    """Cores each named group of a process's threads used over the window (``capacity_worker.thread_cpu``),
    busiest first; those under 0.01 of a core left out."""
    cores = {name: (after[name] - before.get(name, 0.0)) / window for name in after}
    return {name: round(c, 2) for name, c in sorted(cores.items(), key=lambda kv: -kv[1]) if c >= 0.01}


def summarise_level(count: int, added_from: int, start_s: float, first: dict, last: dict, placed: list[Placed],
                    failed: dict[str, str], gpu: dict | None, args: argparse.Namespace) -> dict[str, Any]:
    """One count's figures from the window's two snapshots."""
    window = last["now"] - first["now"]
    slack = 1 / window  # one frame over the window: its ends fall between frames
    sessions = []
    def reported(snapshot: dict, name: str, session_id: str) -> dict | None:
        return snapshot["replies"].get(name, {}).get("sessions", {}).get(session_id)

    for p in placed:
        w0, w1 = reported(first, p.worker, p.session_id), reported(last, p.worker, p.session_id)
        c0, c1 = reported(first, p.client, p.session_id), reported(last, p.client, p.session_id)
        row: dict[str, Any] = {"session": p.session_id, "worker": p.worker, "client": p.client}
        if p.engine is not None:
            row["engine"] = p.engine
        if p.session_id in failed or not (w0 and w1 and c0 and c1):
            row.update(playout_fps=0.0, received_fps=0.0, held=False,
                       problem=failed.get(p.session_id, "not reported by its worker or client"))
            sessions.append(row)
            continue
        dt_w = last["replies"][p.worker]["now"] - first["replies"][p.worker]["now"]
        dt_c = last["replies"][p.client]["now"] - first["replies"][p.client]["now"]
        turns = [t for t in w1["turns"] if first["wall"] <= t[0] <= last["wall"]]
        row.update(
            playout_fps=round((w1["fresh_frames"] - w0["fresh_frames"]) / dt_w, 3),
            released_fps=round((w1["frames_released"] - w0["frames_released"]) / dt_w, 3),
            received_fps=round((c1["video_frames"] - c0["video_frames"]) / dt_c, 3),
            underruns=w1["underruns"] - w0["underruns"], late_ticks=w1["late_ticks"] - w0["late_ticks"],
            **{k: w1[k] - w0[k] for k in CAUSE_KEYS},
            skipped_video_frames=(w1["skipped_video_frames"] - w0["skipped_video_frames"]
                                  if w1["skipped_video_frames"] is not None and w0["skipped_video_frames"] is not None
                                  else None),
            frames_released_total=w1["frames_released"], frames_received_total=c1["video_frames"],
            connected_at=c1["connected_at"], turns=len(turns),
            pipeline_median_ms=round(1e3 * statistics.median(t[1] for t in turns), 1) if turns else None,
            ended=w1["ended"] or c1["ended"])
        row["held"] = (row["playout_fps"] >= args.min_fps - slack and row["received_fps"] >= args.min_fps - slack
                       and row["ended"] is None)
        sessions.append(row)
    window_turns = [t for p in placed if (w := reported(last, p.worker, p.session_id))
                    for t in w["turns"] if first["wall"] <= t[0] <= last["wall"]]
    pipeline = [t[1] * 1e3 for t in window_turns]
    total = [t[2] * 1e3 for t in window_turns if t[2] is not None]  # user's end of speech -> the client shows it
    steps = [s for name, r in last["replies"].items() if name.startswith(("worker", "engine")) for s in r.get("step_ms", [])]
    processes = []
    for name, reply in last["replies"].items():
        if name not in first["replies"]:
            continue
        cpu = _delta(first["cpu"][name], last["cpu"][name])
        entry = {"name": name, "sessions": sum(name in (p.worker, p.client, p.engine) for p in placed),
                 "cores": round(cpu["process"] / window, 3), "main_thread": round(cpu["main_thread"] / window, 3),
                 "child_processes_cores": round(cpu["children"] / window, 3), "loop_lag": reply["loop_lag"]}
        if "hosted" in reply:  # an engine: the sessions it hosted when the window closed
            entry["hosted"] = reply["hosted"]
        if "cuda_context" in reply:  # a server worker: whether it made a CUDA context (engine hosting: never)
            entry["cuda_context"] = reply["cuda_context"]
        if "threads" in reply:  # a server worker: where its cores went, by thread
            entry["threads_cores"] = thread_cores(first["replies"][name]["threads"], reply["threads"], window)
        for kind, now in reply.get("batchers", {}).items():  # sessions served per batched forward, in the window
            before = first["replies"][name]["batchers"][kind]
            forwards, served = now["forwards"] - before["forwards"], now["served"] - before["served"]
            entry.setdefault("batched", {})[kind] = {"forwards": forwards, "served": served}
        processes.append(entry)
    busy = _delta(dict(zip(("busy", "steal", "total"), first["host"], strict=True)),
                  dict(zip(("busy", "steal", "total"), last["host"], strict=True)))
    host_busy, host_steal = busy["busy"] / max(1e-9, busy["total"]), busy["steal"] / max(1e-9, busy["total"])
    playout = [s["playout_fps"] for s in sessions]
    received = [s["received_fps"] for s in sessions]
    level = {
        "sessions": count, "start_s": round(start_s, 1), "window_s": round(window, 2),
        # How far apart this count's new sessions' connections came up (--spread-s sets it; 0: within ~1 s).
        "connects_span_s": round(max(up) - min(up), 2) if (up := [s["connected_at"] for s in sessions[added_from:]
                                                                    if s.get("connected_at") is not None]) else None,
        "held": sum(s["held"] for s in sessions), "below": sum(not s["held"] for s in sessions),
        "playout_fps_min": min(playout), "playout_fps_median": statistics.median(playout),
        "received_fps_min": min(received), "received_fps_median": statistics.median(received),
        "underruns": sum(s.get("underruns", 0) for s in sessions),
        **{k: sum(s.get(k, 0) for s in sessions) for k in CAUSE_KEYS},
        "late_ticks": sum(s.get("late_ticks", 0) for s in sessions),
        "pipeline_ms": ({"turns": len(pipeline), **{k: round(v, 1) for k, v in percentiles(pipeline, (50, 90)).items()}}
                        if pipeline else {"turns": 0}),
        "total_ms": ({"turns": len(total), **{k: round(v, 1) for k, v in percentiles(total, (50, 90)).items()}}
                     if total else {"turns": 0}),
        "step_ms": ({"steps": len(steps), **{k: round(v, 2) for k, v in percentiles(steps, (50, 99)).items()}}
                    if steps else None),
        "gpu": gpu, "host_cpu_busy": round(host_busy, 3), "host_cpu_steal": round(host_steal, 3),
        "host_cores": psutil.cpu_count(),
        "bench_process_cores": round(_delta(first["bench_cpu"], last["bench_cpu"])["process"] / window, 3),
        "processes": processes, "process_errors": {**first["errors"], **last["errors"]}, "per_session": sessions,
    }
    level["sessions_per_forward"] = {}
    for kind in ("diffusion", "decode"):
        batched = [p["batched"][kind] for p in processes if kind in p.get("batched", {})]
        if forwards := sum(b["forwards"] for b in batched):
            level["sessions_per_forward"][kind] = round(sum(b["served"] for b in batched) / forwards, 2)
    if gpu and gpu.get("context_pids") is not None:  # which processes hold a CUDA context (engines: only they)
        level["cuda_contexts"] = {"count": len(gpu["context_pids"]),
                                  "processes": sorted(n for n, pid in last["pids"].items() if pid in gpu["context_pids"])}
    level["saturated"] = saturated(level)
    return level


def saturated(level: dict[str, Any]) -> list[str]:
    """The resources at or past their limit in this window, as sentences."""
    found = []
    gpu = level["gpu"]
    if gpu and gpu.get("samples") and gpu["util_mean"] >= 100 * SATURATED:
        found.append(f"GPU busy {gpu['util_mean']:.0f}% (nvidia-smi, mean)")
    if level["host_cpu_busy"] >= SATURATED:
        found.append(f"host CPU {100 * level['host_cpu_busy']:.0f}% of {level['host_cores']} cores")
    if level["host_cpu_steal"] >= STEAL_NOTED:
        found.append(f"the VM's cores ran something else {100 * level['host_cpu_steal']:.0f}% of the time (steal): "
                     "what every process here did not get")
    for p in level["processes"]:
        lag = p["loop_lag"].get("p99_ms", 0.0)
        what = {"worker": "the event loop of server", "engine": "the event loop of engine"}.get(
            p["name"].split("-")[0], "the event loop of the bench's client")
        if p["main_thread"] >= SATURATED:
            found.append(f"{what} {p['name']}: its thread {100 * p['main_thread']:.0f}% of a core, lag p99 {lag:.0f} ms")
        elif lag > 1e3 * FRAME_S:  # late, but its thread not busy: it waited for a core or for the GIL
            busiest = ", ".join(f"{t} {c:.2f}" for t, c in list(p.get("threads_cores", {}).items())[:4])
            found.append(f"{what} {p['name']} late (lag p99 {lag:.0f} ms > a frame) at {100 * p['main_thread']:.0f}% "
                         f"of a core, the process's other threads {p['cores'] - p['main_thread']:.2f} cores: "
                         "starved (of a core or the GIL), not busy" + (f" (busiest threads, cores: {busiest})"
                                                                       if busiest else ""))
    return found


async def ladder(args: argparse.Namespace, batch_sessions: int, budget_s: float | None,
                 on_level) -> dict[str, Any]:
    config = session_config(args, batch_sessions)
    began = time.monotonic()
    procs = Processes()
    procs.start_reading()
    result: dict[str, Any] = {"batch_sessions": batch_sessions, "levels": [], "stopped": None}
    folder = tempfile.TemporaryDirectory(prefix="cs-engines-")  # the engines' sockets
    engines: Engines | None = None
    weights = None if args.weights == "random" else args.weights  # build_graph's: None = seeded random weights
    try:
        if args.engines:
            engines = Engines(args.engines, config, weights, folder.name, per_process(args), args.family)
            await engines.wait_ready(args.start_timeout)
            result["engines"] = {name: {"endpoint": ep, "pid": engines.pids[name], **engines.devices[name]}
                                 for name, ep in engines.endpoints.items()}
        for i in range(args.workers):
            worker_config = config
            if engines is not None:  # its sessions' model stages in its engine
                worker_config = dataclasses.replace(config, engine_endpoint=engines.endpoints[engine_of(i, args.engines)])
            procs.launch(f"worker-{i}", run_worker, procs.endpoint, f"worker-{i}", worker_config, weights,
                         args.log_level, args.family, args.portrait_image)
        for i in range(args.clients):
            procs.launch(f"client-{i}", run_clients, procs.endpoint, f"client-{i}", args.start_timeout, args.client_nice)
        await procs.wait_hello(args.start_timeout)
        result["startup_s"] = round(time.monotonic() - began, 1)
        result["workers"] = {n: {k: v for k, v in h.items() if k not in ("id", "hello")}
                             for n, h in procs.hello.items() if n.startswith("worker")}
        result["pids"] = {n: h["pid"] for n, h in procs.hello.items()} | (engines.pids if engines else {})
        result["clients_nice"] = {n: h["nice"] for n, h in procs.hello.items() if n.startswith("client")}
        run = Ladder(args, config, procs, engines)
        result["warmup_sessions_s"] = round(await run.warm_up(), 1)
        with tqdm(total=round(args.hold), unit="s", dynamic_ncols=True,
                  bar_format="{desc} |{bar}| {n_fmt}/{total_fmt} s{postfix}") as progress:
            for count in args.sessions:
                if count <= len(run.placed):
                    continue
                # Starting scales with the sessions added (the warm-up started one per worker).
                added = count - len(run.placed)
                if result["levels"]:
                    last = result["levels"][-1]
                    start_s = last["start_s"] * added / max(1, last["sessions"] - last["added_from"])
                else:
                    start_s = result["warmup_sessions_s"] * added / args.workers
                needed = start_s + args.warmup + args.hold
                if budget_s is not None and time.monotonic() - began + needed > budget_s:
                    result["stopped"] = f"{count} sessions not started: ~{needed:.0f} s more would pass the {budget_s:.0f} s budget"
                    break
                level = await run.level(count, progress)
                result["levels"].append(level)
                tqdm.write(level_line(level, args.min_fps))
                on_level(result)
                if level["process_errors"]:
                    result["stopped"] = "a process failed: " + "; ".join(level["process_errors"].values())
                    break
                if level["below"]:
                    reasons = "; ".join(level["saturated"]) or "no measured resource at >= 90% (see the per-session rows)"
                    result["stopped"] = (f"{level['below']} of {count} sessions below {args.min_fps:g} fps; "
                                         f"saturated: {reasons}")
                    break
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"
        result["traceback"] = traceback.format_exc(limit=-6)  # where, for a first run on a new machine
    finally:
        result["process_exits"] = await procs.close()
        if engines is not None:  # after the workers: their sessions have ended
            result["process_exits"].update(await engines.close())
        folder.cleanup()
    held = [lv["sessions"] for lv in result["levels"] if not lv["below"]]
    result["capacity"] = max(held) if held else 0
    result["wall_s"] = round(time.monotonic() - began, 1)
    return result


def level_line(level: dict[str, Any], min_fps: float) -> str:
    gpu = level["gpu"]
    gpu_text = f", GPU {gpu['util_mean']:.0f}%" if gpu and gpu.get("samples") else ""
    pipeline = level["pipeline_ms"].get("p50")
    return (f"{level['sessions']} sessions: {level['held']} held {min_fps:g} fps, playout min "
            f"{level['playout_fps_min']:.2f}, received min {level['received_fps_min']:.2f}, "
            f"{level['underruns']} underruns, pipeline p50 {pipeline if pipeline is not None else '-'} ms, "
            f"host CPU {100 * level['host_cpu_busy']:.0f}%{gpu_text}")


def table(report: dict[str, Any]) -> str:
    rows = [["batch", "sessions", "held", "playout fps min/med", "received fps min/med",
             "underruns (" + "/".join(UNDERRUN_CAUSES) + ")",
             "pipeline p50/p90 ms", "step p50/p99 ms", "batched step/decode", "GPU busy", "host CPU (steal)", "worst loop lag p99", "saturated"]]
    for result in report["ladders"]:
        for lv in result["levels"]:
            p, s, g, per = lv["pipeline_ms"], lv["step_ms"], lv["gpu"], lv["sessions_per_forward"]
            worker_lag = max((x["loop_lag"].get("p99_ms", 0.0) for x in lv["processes"] if x["name"].startswith("worker")),
                             default=0.0)
            rows.append([str(result["batch_sessions"]), str(lv["sessions"]), f"{lv['held']}/{lv['sessions']}",
                         f"{lv['playout_fps_min']:.2f} / {lv['playout_fps_median']:.2f}",
                         f"{lv['received_fps_min']:.2f} / {lv['received_fps_median']:.2f}",
                         f"{lv['underruns']} (" + "/".join(str(lv.get(k, 0)) for k in CAUSE_KEYS) + ")",
                         f"{p['p50']:.0f} / {p['p90']:.0f}" if p.get("turns") else "-",
                         f"{s['p50']:.2f} / {s['p99']:.2f}" if s else "-",
                         " / ".join(f"{per.get(k, 0):.1f}" for k in ("diffusion", "decode")) if per else "-",
                         f"{g['util_mean']:.0f}%" if g and g.get("samples") else "-",
                         f"{100 * lv['host_cpu_busy']:.0f}% ({100 * lv['host_cpu_steal']:.0f}%)", f"{worker_lag:.0f} ms",
                         "; ".join(lv["saturated"]) or "-"])
    where = f"--gpus {report['gpus']}" if report["gpus"] else "CPU"
    engines = f"{report['engines']} engine / " if report.get("engines") else ""
    lines = [f"capacity: {report['preset']} sessions, {where}, hosting {report['hosting']}, "
             f"{engines}{report['workers']} server / {report['clients']} client processes (nice {report['client_nice']}), "
             f"agent pace {report['agent_pace']}, "
             f"sessions started {f'over {spread:g} s' if (spread := report.get('spread_s')) else 'at once'}, "
             f"{report['hold_s']:g} s windows, "
             f"held = both fps >= {report['min_fps']:g} less one frame per window, "
             f"host: a core's Python loop {report['host_loop_ms']:g} ms at start", text_table(rows)]
    for result in report["ladders"]:
        for lv in result["levels"]:
            workers = [p for p in lv["processes"] if "cuda_context" in p]
            if report.get("engines") and workers:
                lines.append(f"batch {result['batch_sessions']}, {lv['sessions']} sessions: server processes with a CUDA "
                             f"context: {sum(p['cuda_context'] for p in workers)} of {len(workers)}")
            if "cuda_contexts" in lv:
                contexts = lv["cuda_contexts"]
                lines.append(f"batch {result['batch_sessions']}, {lv['sessions']} sessions: {contexts['count']} CUDA "
                             f"contexts on GPU 0 ({', '.join(contexts['processes']) or 'pids not ours'})")
            for p in lv["processes"]:
                if p["name"].startswith("engine"):
                    per = p.get("batched", {})
                    forwards = " / ".join(f"{b['served'] / b['forwards']:.1f}" if b["forwards"] else "-"
                                          for b in (per.get("diffusion"), per.get("decode")) if b is not None)
                    lag = p["loop_lag"]
                    lines.append(f"batch {result['batch_sessions']}, {lv['sessions']} sessions: {p['name']} hosted "
                                 f"{p.get('hosted')} sessions, {p['cores']:.2f} cores (main thread {p['main_thread']:.2f}), "
                                 f"loop lag p50/p99 {lag.get('p50_ms', '-')}/{lag.get('p99_ms', '-')} ms, "
                                 f"sessions per forward step/decode {forwards or '-'}")
    for result in report["ladders"]:
        verdict = f"batch_sessions {result['batch_sessions']}: capacity {result['capacity']} sessions"
        if result.get("stopped"):
            verdict += f"; stopped: {result['stopped']}"
        if result.get("error"):
            verdict += f"; ERROR: {result['error']}"
        lines.append(verdict)
    lines.append(f"load avg 1/5/15 min at end: {report['load_avg_at_end']}")
    return "\n".join(lines)


def host_loop_ms(repeats: int = 5) -> float:
    """One core's pace for pure Python, in ms: the median of ``repeats`` timings of a fixed loop (10^6
    squares summed). Hosts of one kind differ in pace, and so does what they hold (docs/PERF.md,
    Capacity); taken before any bench process starts, this tells them apart in a report."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        sum(i * i for i in range(1_000_000))
        times.append(time.perf_counter() - started)
    return round(1e3 * statistics.median(times), 1)


def run(args: argparse.Namespace) -> int:
    if sorted(set(args.sessions)) != args.sessions or args.sessions[0] < 1:
        raise SystemExit("charstream bench capacity: --sessions must be increasing positive counts")
    if args.workers < 1 or args.clients < 1:
        raise SystemExit("charstream bench capacity: --workers and --clients must be at least 1")
    if not 0 <= args.client_nice <= 19:  # raising a process's priority needs privileges the bench does not ask for
        raise SystemExit(f"charstream bench capacity: --client-nice must be 0-19, got {args.client_nice}")
    if args.engines < 0 or args.engines > args.workers:
        raise SystemExit("charstream bench capacity: --engines must be 0..--workers (each worker's sessions use one engine)")
    try:  # the model (FlashHead: its weights folder checked from the headers, and the portrait)
        args.family = arguments.sized_family(args.preset, args.blocks, args.size, args.vae_width)
        _, args.portrait_image = arguments.model_choice(args.preset, args.weights, args.portrait)
    except ValueError as e:
        raise SystemExit(f"charstream bench capacity: {e}") from None
    if args.family.generation_mode == "chunk_motion" and hosting(args) not in ("inproc", "engine"):
        raise SystemExit(f"charstream bench capacity: {args.preset} runs a session's model stages in one process "
                         "(hosting inproc or engine)")
    if args.min_fps is None:
        args.min_fps = float(args.family.timeline.fps)
    per = per_process(args)
    where = "engine" if args.engines else "worker"
    for k in args.batch_sessions:
        try:
            config = session_config(args, k)  # a bad layout, preset or batching value fails here, before any process
            if args.engines:
                check_engine_config(config, per)
        except ValueError as e:
            raise SystemExit(f"charstream bench capacity: {e}") from None
        if k > 1 and per > k:  # a worker's (an engine's) batcher takes at most batch_sessions sessions
            raise SystemExit(f"charstream bench capacity: --batch-sessions {k} serves at most {k} sessions per "
                             f"{where}; {max(args.sessions)} sessions on {args.engines or args.workers} {where}s need {per}")
    configure_logging("error")
    report: dict[str, Any] = {
        "bench": "capacity", "preset": args.preset, "weights": args.weights, "gpus": args.gpus,
        "blocks": args.blocks, "size": args.size, "vae_width": args.vae_width,
        "hosting": hosting(args), "engines": args.engines, "workers": args.workers, "clients": args.clients,
        "client_nice": args.client_nice, "sessions": args.sessions,
        "hold_s": args.hold, "warmup_s": args.warmup, "min_fps": args.min_fps, "budget_s": args.budget_s,
        "recognizer": args.recognizer, "agent_pace": args.agent_pace, "spread_s": args.spread_s, "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {psutil.cpu_count()} CPUs, {platform.platform()}", "commit": commit_id(),
        "load_avg_at_start": [round(x, 2) for x in psutil.getloadavg()], "host_loop_ms": host_loop_ms(), "ladders": [],
    }

    def write(result: dict[str, Any] | None = None) -> None:
        ladders = report["ladders"] + ([result] if result is not None else [])
        Path(args.out).write_text(json.dumps({**report, "ladders": ladders, "partial": result is not None}, indent=2) + "\n")

    for k in args.batch_sessions:
        report["ladders"].append(asyncio.run(ladder(args, k, args.budget_s, write)))
        write()
    report["load_avg_at_end"] = [round(x, 2) for x in psutil.getloadavg()]
    report["partial"] = False
    emit_report(report, table(report), args.out, args.json)
    return 1 if any(r.get("error") or not r["levels"] for r in report["ladders"]) else 0
