"""``charstream bench soak``: hours of use on one server — memory, descriptors, threads, shared memory.

Two runs, each on one ``EgressServer`` in this process with the real session factory and the
in-process aiortc client on a loop of its own (``demo.ClientThread``):

* ``--sessions N --seconds S`` — N sequential sessions of S seconds each. After each ended
  session (server and factory both empty) it samples RSS, open fds, threads, shared-memory slot
  blocks still mapped and child processes. Reported: the slope of RSS per session after the warm-up
  (a least-squares fit), the retained MB per ended session, and the same after ``malloc_trim``
  (what glibc holds but could return, not a leak).
Every sample also holds glibc's own account (``malloc_info``: arenas, heap, free pool, mapped
blocks), which tells memory the process uses from memory its allocator keeps.
The agent is the scripted one (its user and its replies synthesised, the built-in script
repeated), so the character talks through the whole model path without a microphone.

* ``--minutes M`` — one session for M minutes, sampled every ``--every`` s: the RSS slope in
  MB/min (fitted after the first ``WARMUP_FRACTION`` of the run), fps held (playout's fresh frames per second), underruns, and frames lost: frames the
  24 fps clock owed minus frames playout released, and released minus received by the client.
  Also the process's CPU seconds per minute and page faults per second after the warm-up (what the
  allocator's settings cost), and glibc's free pool and arenas at the first and last fitted sample.

With ``--hosting processes`` both runs also report each stage process's exit after its session's stop
began and whether it needed a signal (``Supervisor.stop``: grace, then SIGTERM, then SIGKILL).

    charstream bench soak --sessions 200 --seconds 1 --out bench-soak-sessions.json
    charstream bench soak --minutes 30 --out bench-soak-session.json
    charstream bench soak --sessions 20 --hosting processes --out bench-soak-processes.json
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import math
import platform
import resource
import time
from datetime import UTC, datetime
from typing import Any

import numpy as np
import psutil

from charstream.logs import configure_logging
from charstream.pipeline import arguments
from charstream.pipeline.bench.output import commit_id, emit_report, text_table
from charstream.pipeline.config import PipelineConfig
from charstream.stages.config import EgressConfig
from charstream.stages.playout.stats import UNDERRUN_CAUSES
from charstream.stages.shared.memory import allocator_stats, release_free_memory
from charstream.timeline import CHARACTERS
from charstream.transport.slots import mapped_blocks

MIN_TURN_S = 6.0  # a scripted turn (user line, think, reply, gap) takes longer than this
WARMUP_FRACTION = 0.1  # sessions before the fit: caches, allocator arenas and lazy imports settle


def sample(collect: bool = True) -> dict[str, float]:
    """The process's resources now; ``collect``: after a full garbage collection (between sessions only:
    on a large heap it holds the GIL for ~0.15 s, which a live session's playout clock feels)."""
    started = time.perf_counter()
    if collect:
        gc.collect()
    process = psutil.Process()
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of the process
    return {
        "t": time.monotonic(),
        "cpu_s": round(usage.ru_utime + usage.ru_stime, 3),
        "page_faults": usage.ru_minflt + usage.ru_majflt,
        "rss_mb": round(process.memory_info().rss / 2**20, 2),
        "fds": process.num_fds(),
        "threads": process.num_threads(),
        "shm_segments": mapped_blocks(),
        "children": len(process.children(recursive=True)),
        **{f"malloc_{k}": v for k, v in allocator_stats().items()},  # glibc's heaps, its free pool, mapped blocks
        "sample_ms": round((time.perf_counter() - started) * 1e3, 2),
    }


class GcPauses:
    """Python's own garbage collections while installed (``gc.callbacks``): how many of each generation
    and how long the longest held the GIL -- the pauses a serving process has without anyone sampling."""

    def __init__(self) -> None:
        self.durations: dict[int, list[float]] = {0: [], 1: [], 2: []}
        self._started = 0.0

    def __enter__(self) -> GcPauses:
        gc.callbacks.append(self._on_gc)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.durations[info["generation"]].append(time.perf_counter() - self._started)

    def summary(self) -> dict[str, dict[str, float]]:
        return {f"gen{g}": {"collections": len(d), "max_ms": round(max(d, default=0.0) * 1e3, 2),
                            "p99_ms": round(float(np.percentile(d, 99)) * 1e3, 2) if d else 0.0}
                for g, d in self.durations.items()}


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (0 with fewer than two points)."""
    if len(xs) < 2:
        return 0.0
    return float(np.polyfit(np.asarray(xs, float), np.asarray(ys, float), 1)[0])


class Harness:
    """The server, the factory and a way to run one client session on it."""

    def __init__(self, source: str, config: PipelineConfig) -> None:
        from charstream.pipeline.runtime.process import MemoryTrimmer
        from charstream.pipeline.session import session_factory
        from charstream.pipeline.web.server import EgressServer

        self.factory = session_factory(config, testcard=source == "testcard")
        self.server = EgressServer(config.egress, self.factory)
        self.trimmer = MemoryTrimmer(config.egress.memory_trim_s)  # this process owns the serving loop
        self.url = ""
        self.fps = config.timeline.fps

    async def start(self) -> None:
        self.url = await self.server.start()
        self.trimmer.start()

    async def session(self, seconds: float, every: float | None = None,
                      on_sample=None) -> dict[str, Any]:
        """One client session, ``seconds`` from its first video frame; its playout figures and what
        the client got."""
        from charstream.pipeline.demo import ClientThread

        session_id, token = self.server.create_session()
        client = ClientThread(None, self.fps)
        await client.connect(self.url, token)
        live = self.factory.sessions[session_id]
        await client._call(client.client.wait_for_video(1, timeout=120))  # the model loads first
        started = time.monotonic()
        while time.monotonic() - started < seconds and not live.output.closed:
            await asyncio.sleep(min(every or seconds, seconds - (time.monotonic() - started)))
            if on_sample is not None:
                await on_sample(live, client.client)
        stats = live.stages["playout"].stats.summary()
        received, ended_early = client.client.video_frames, live.output.closed
        await client.close()
        deadline = time.monotonic() + 30
        while (self.server.sessions or self.factory.sessions) and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        # Each stage process's exit after the session's stop began, and the signal it needed, if any.
        stops = live.result.stops if live.result is not None else {}
        return {"playout": stats, "received": received, "ended_early": ended_early,
                "released": not (self.server.sessions or self.factory.sessions), "stage_processes": stops}

    async def stop(self) -> None:
        await self.trimmer.stop()
        await self.server.stop()


async def soak_sessions(source: str, config: PipelineConfig, count: int, seconds: float) -> dict[str, Any]:
    harness = Harness(source, config)
    await harness.start()
    baseline = sample()
    samples, unreleased, ended_early, stops = [], 0, 0, {}
    try:
        for i in range(count):
            result = await harness.session(seconds)
            unreleased += not result["released"]
            ended_early += result["ended_early"]
            for group, outcome in result["stage_processes"].items():
                stops.setdefault(group, []).append(outcome)
            samples.append({"session": i + 1, **sample(), "stage_processes": result["stage_processes"]})
    finally:
        await harness.stop()
    warm = max(1, int(count * WARMUP_FRACTION))
    fit = samples[warm - 1:]
    before_trim = sample()
    release_free_memory()
    after_trim = sample()
    retained = (fit[-1]["rss_mb"] - fit[0]["rss_mb"]) / max(1, len(fit) - 1)
    return {
        "mode": "sessions", "source": source, "sessions": count, "seconds_each": seconds,
        "baseline": baseline, "end": before_trim, "end_after_malloc_trim": after_trim,
        "rss_slope_mb_per_session": round(slope([s["session"] for s in fit], [s["rss_mb"] for s in fit]), 3),
        "retained_mb_per_session": round(retained, 3),
        "retained_mb_per_session_after_trim": round((after_trim["rss_mb"] - fit[0]["rss_mb"]) / max(1, len(fit) - 1), 3),
        "fds_growth": before_trim["fds"] - fit[0]["fds"], "threads_growth": before_trim["threads"] - fit[0]["threads"],
        "shm_segments_left": before_trim["shm_segments"], "children_left": before_trim["children"],
        "sessions_not_released": unreleased, "sessions_ended_early": ended_early,
        "stage_processes": {group: {"exit_s_max": max((o["exit_s"] or math.inf) for o in outcomes),
                                    "signalled": sum(o["signal"] is not None for o in outcomes),
                                    "stops": len(outcomes)} for group, outcomes in stops.items()},
        "samples": samples,
    }


async def soak_session(source: str, config: PipelineConfig, minutes: float, every: float,
                       trim: bool = False) -> dict[str, Any]:
    harness = Harness(source, config)
    await harness.start()
    samples = []

    async def on_sample(live, client) -> None:
        # Off the event loop and without a forced collection: the sampler must not stall the session it measures.
        stats = live.stages["playout"].stats
        counters = {"frames_released": stats.frames_released, "fresh_frames": stats.fresh_frames,
                    "underruns": stats.underruns, "received": client.video_frames}
        samples.append({**await asyncio.to_thread(sample, False), **counters})
        if trim:  # what the process holds live, without what glibc keeps free for later
            await asyncio.to_thread(release_free_memory)
            samples[-1]["rss_trimmed_mb"] = (await asyncio.to_thread(sample, False))["rss_mb"]

    try:
        with GcPauses() as pauses:
            result = await harness.session(minutes * 60, every, on_sample)
        last = sample()  # the session over, the server still up
        release_free_memory()
        trimmed = sample()
    finally:
        await harness.stop()
    playout = result["playout"]
    t0 = samples[0]["t"] if samples else 0.0
    fit = [s for s in samples if s["t"] - t0 >= WARMUP_FRACTION * minutes * 60]
    axis = [(s["t"] - t0) / 60 for s in fit]
    owed = round(playout["elapsed_s"] * CHARACTERS.fps)
    span_min = axis[-1] - axis[0] if len(fit) > 1 else 0.0

    def per_min(key: str) -> float | None:  # the fitted stretch's increase of a counter, per minute
        return (fit[-1][key] - fit[0][key]) / span_min if span_min > 0 else None

    faults = per_min("page_faults")
    return {
        "mode": "session", "source": source, "minutes": minutes, "ended_early": result["ended_early"],
        "rss_slope_mb_per_min": round(slope(axis, [s["rss_mb"] for s in fit]), 3),
        "rss_trimmed_slope_mb_per_min": round(slope(axis, [s["rss_trimmed_mb"] for s in fit]), 3) if trim else None,
        "fds_slope_per_min": round(slope(axis, [s["fds"] for s in fit]), 3),
        "threads_slope_per_min": round(slope(axis, [s["threads"] for s in fit]), 3),
        "shm_segments_max": max((s["shm_segments"] for s in samples), default=0),
        "malloc_free_mb_first_last": [fit[0].get("malloc_free_mb"), fit[-1].get("malloc_free_mb")] if fit else None,
        "malloc_arenas_first_last": [fit[0].get("malloc_arenas"), fit[-1].get("malloc_arenas")] if fit else None,
        "cpu_s_per_min": None if span_min <= 0 else round(per_min("cpu_s"), 2),
        "page_faults_per_s": None if faults is None else round(faults / 60),
        "rss_after_session_mb": last["rss_mb"], "rss_after_malloc_trim_mb": trimmed["rss_mb"],
        "fps_held": playout["achieved_fps"], "underruns": playout["underruns"],
        "underrun_frames": playout["underrun_frames"],
        **{f"{cause}_{what}": playout[f"{cause}_{what}"] for cause in UNDERRUN_CAUSES
           for what in ("underruns", "underrun_frames")},
        "late_chunks": playout["late_chunks"], "frames_owed_by_clock": owed,
        "gc_pauses": pauses.summary(), "sample_ms_max": max((s["sample_ms"] for s in samples), default=0.0),
        "frames_released": playout["frames_released"], "frames_received": result["received"],
        "frames_lost_clock": owed - playout["frames_released"],
        "frames_lost_network": playout["frames_released"] - result["received"],
        "stage_processes": result["stage_processes"],
        "playout": playout, "samples": samples,
    }


def table(report: dict[str, Any]) -> str:
    r = report["result"]
    if r["mode"] == "sessions":
        rows = [["sessions", "rss start", "rss end", "MB/session (fit)", "retained MB/session", "after trim",
                 "fds +", "threads +", "shm left", "children left", "not released"],
                [str(r["sessions"]), str(r["baseline"]["rss_mb"]), str(r["end"]["rss_mb"]),
                 str(r["rss_slope_mb_per_session"]), str(r["retained_mb_per_session"]),
                 str(r["retained_mb_per_session_after_trim"]), str(r["fds_growth"]), str(r["threads_growth"]),
                 str(r["shm_segments_left"]), str(r["children_left"]), str(r["sessions_not_released"])]]
    else:
        rows = [["minutes", "MB/min", "fds/min", "threads/min", "fps held",
                 "underruns (" + "/".join(UNDERRUN_CAUSES) + ")", "lost (clock)", "lost (network)", "released",
                 "received", "CPU s/min", "faults/s", "free pool MB", "arenas", "gc gen2 (max ms)", "sample max ms"],
                [str(r["minutes"]), str(r["rss_slope_mb_per_min"]), str(r["fds_slope_per_min"]),
                 str(r["threads_slope_per_min"]), str(r["fps_held"]),
                 f"{r['underruns']} (" + "/".join(str(r[f"{c}_underruns"]) for c in UNDERRUN_CAUSES) + ")",
                 str(r["frames_lost_clock"]), str(r["frames_lost_network"]), str(r["frames_released"]),
                 str(r["frames_received"]), str(r["cpu_s_per_min"]), str(r["page_faults_per_s"]),
                 " -> ".join(map(str, r["malloc_free_mb_first_last"] or [])),
                 " -> ".join(map(str, r["malloc_arenas_first_last"] or [])),
                 f"{r['gc_pauses']['gen2']['collections']} ({r['gc_pauses']['gen2']['max_ms']})", str(r["sample_ms_max"])]]
    text = text_table(rows)
    processes = r.get("stage_processes") or {}  # hosting processes: how each stage process ended when stopped
    if processes and r["mode"] == "sessions":
        text += "\n" + text_table([["stage process", "exit after stop, max s", "stops that needed a signal"]] + [
            [group, str(p["exit_s_max"]), f"{p['signalled']} of {p['stops']}"] for group, p in processes.items()])
    elif processes:
        text += "\n" + text_table([["stage process", "exit after stop s", "grace s", "needed a signal", "exit code"]] + [
            [group, str(p["exit_s"]), str(p["grace_s"]), f"{p['signal']} ({p['why']})" if p["signal"] else "no",
             str(p["exitcode"])] for group, p in processes.items()])
    return text + f"\nload avg 1/5/15 min at end: {report['load_avg_at_end']}"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--source", choices=["pipeline", "testcard"], default="pipeline")
    parser.add_argument("--hosting", choices=["inproc", "processes"], default="inproc",
                        help="processes: diffusion and decode in processes of their own (ipc, shared-memory slots)")
    arguments.renamed(parser, "--placement", "--hosting")
    parser.add_argument("--sessions", type=arguments.positive_int, help="sequential sessions (the per-session memory run)")
    parser.add_argument("--seconds", type=float, default=1.0, help="length of each of --sessions")
    parser.add_argument("--minutes", type=float, help="one session this long (the long-session run)")
    parser.add_argument("--every", type=float, default=10.0, help="seconds between samples of --minutes")
    parser.add_argument("--trim", action="store_true",
                        help="--minutes: malloc_trim after each sample and record that RSS too (live memory vs glibc's free pool)")
    parser.add_argument("--memory-trim-s", type=float, help="the server's egress.memory_trim_s (0: never)")
    parser.add_argument("--log-level", default="error",
                        help="the session's log lines (JSON on stderr) at this level; info names each turn's speech and underrun")
    parser.add_argument("--json", action="store_true", help="print the report as JSON (the table goes to stderr)")
    parser.add_argument("--out", default="bench-soak.json", help="also write the JSON report here")


def run(args: argparse.Namespace) -> int:
    if (args.sessions is None) == (args.minutes is None):
        raise SystemExit("charstream bench soak: give exactly one of --sessions N or --minutes M")
    import torch

    from charstream.stages.agents.scripted import DEFAULT_SCRIPT

    configure_logging(args.log_level)
    config = PipelineConfig(hosting=args.hosting)
    config.egress = EgressConfig(port=0, max_sessions=2)
    if args.memory_trim_s is not None:
        config.egress.memory_trim_s = args.memory_trim_s
    # The scripted agent talks without a microphone; its script repeated, the character speaks all along
    # (every line is synthesised up front: no more repeats than the run can use).
    seconds = args.minutes * 60 if args.minutes is not None else args.seconds
    repeats = max(1, math.ceil(seconds / (len(DEFAULT_SCRIPT) * MIN_TURN_S)))
    config.ingest.adapter = "scripted"
    config.ingest.script = [{"user": line.user, "agent": line.agent} for line in DEFAULT_SCRIPT] * repeats
    load_start = [round(x, 2) for x in psutil.getloadavg()]
    commit = commit_id()  # the tree that runs: read before the run, the checkout may move meanwhile
    started = datetime.now(UTC).isoformat(timespec="seconds")
    if args.sessions is not None:
        result = asyncio.run(soak_sessions(args.source, config, args.sessions, args.seconds))
    else:
        result = asyncio.run(soak_session(args.source, config, args.minutes, args.every, args.trim))
    report = {
        "hosting": args.hosting,
        "memory_trim_s": config.egress.memory_trim_s,
        "started": started,
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {psutil.cpu_count()} CPUs, {platform.platform()}",
        "commit": commit,
        "torch": torch.__version__,
        "load_avg_at_start": load_start,
        "load_avg_at_end": [round(x, 2) for x in psutil.getloadavg()],
        "result": result,
    }
    emit_report(report, table(report), args.out, args.json)
    return 0
