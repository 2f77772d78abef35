"""``charstream bench fleet``: concurrent test-card sessions through a fleet's front door, on loopback.

    charstream bench fleet [--nodes 4,4,4] [--sessions 1,2,4,6] [--seconds 20] [--out FILE] [--json]
                           [--layout cpu] [--source testcard|pipeline] [--preset tiny] [--cluster ADDRESS]

It starts a local Ray cluster (``cluster.py``: one raylet per node on this machine, each with
``--nodes`` devices: CPU devices for the ``cpu`` layout, GPUs for a GPU layout such as ``1`` or
``3+1``) and a front door in this process; for each count in ``--sessions`` it
admits that many aiortc clients at once through the front door, lets them play for ``--seconds``
and reads each session's fps over that window: on its node, the fresh frames playout released per
second (what fleet health counts), and at the client, the video frames it received per second.
Then every client hangs up and the next count starts on an empty fleet. The share of sessions at or
below ``slow_fps`` is the fleet-health figure. A count past the fleet's capacity is reported as
refused (503), not run. Bounded: each step ends after its window; the local cluster is on 127.0.0.2. With ``--cluster`` the
same steps run on an existing Ray cluster (a GPU fleet: ``--layout 3+1 --source pipeline --preset
characters-57b``), whose nodes the clients then reach; there, ``charstream fleet status`` and
``/metrics`` give the same figures for real traffic.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import time

from charstream.pipeline import arguments
from charstream.pipeline.bench.output import commit_id, emit_report, text_table
from charstream.pipeline.config import PipelineConfig
from charstream.pipeline.fleet.client import FleetClient, FullError
from charstream.pipeline.fleet.layout import session_layout

KEY = "bench"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cluster", metavar="ADDRESS",
                        help="run on this Ray cluster (a GPU fleet) instead of starting a local one")
    parser.add_argument("--nodes", type=arguments.counts, default="4,4,4",
                        help="devices per node, comma-separated (a cpu-layout session takes 2)")
    parser.add_argument("--sessions", type=arguments.counts, default="1,2,4,6",
                        help="concurrent session counts to run, comma-separated")
    parser.add_argument("--seconds", type=float, default=20.0, help="measured window per count")
    parser.add_argument("--max-sessions-per-node", type=int, default=2)
    parser.add_argument("--layout", default="cpu", help="each session's layout (pipeline/runtime/layouts.py)")
    parser.add_argument("--source", choices=["testcard", "pipeline"], default="testcard",
                        help="what each session streams (pipeline: the model, --preset)")
    parser.add_argument("--preset", default="tiny", help="model preset of pipeline sessions")
    parser.add_argument("--out", help="write the JSON report here")
    parser.add_argument("--json", action="store_true", help="print the JSON report (the table goes to stderr)")


async def first_frames(client: FleetClient, frames: int = 24, timeout: float = 120.0) -> None:
    """Wait for ``frames`` video frames; a session that ends first fails the step with its reason."""
    video = asyncio.create_task(client.media.wait_for_video(frames, timeout))
    ended = asyncio.create_task(client.ended_event.wait())
    await asyncio.wait([video, ended], return_when=asyncio.FIRST_COMPLETED)
    ended.cancel()
    if not video.done():
        video.cancel()
        raise RuntimeError(f"session {client.session_id} ended before its first frames: {client.ended}")
    video.result()


async def run_step(url: str, door, count: int, seconds: float) -> dict:
    clients = [FleetClient(url, KEY) for _ in range(count)]
    try:
        try:
            await asyncio.gather(*(c.reserve() for c in clients))
        except FullError as e:
            return {"sessions": count, "refused": str(e)}
        await asyncio.gather(*(c.connect() for c in clients))
        await asyncio.gather(*(first_frames(c) for c in clients))
        await asyncio.sleep(2.0)  # past the start: every session's clock running
        await door.refresh_figures()
        start = {s.session_id: (s.played_s, (s.average_fps or 0.0) * s.played_s) for s in door.sessions.values()}
        received = [c.media.video_frames for c in clients]
        began, load_before = time.monotonic(), os.getloadavg()[0]
        await asyncio.sleep(seconds)
        await door.refresh_figures()
        window = time.monotonic() - began
        node_fps = []
        for client in clients:
            session = door.sessions[client.session_id]
            played0, fresh0 = start[client.session_id]
            node_fps.append((session.average_fps * session.played_s - fresh0) / (session.played_s - played0))
        client_fps = [(c.media.video_frames - n) / window for c, n in zip(clients, received, strict=True)]
        slow = sum(fps <= door.fleet.slow_fps for fps in node_fps)
        return {"sessions": count, "window_s": round(window, 2),
                "nodes_used": len({door.sessions[c.session_id].node_id for c in clients}),
                "node_fps": [round(f, 2) for f in node_fps], "client_fps": [round(f, 2) for f in client_fps],
                "node_fps_min": round(min(node_fps), 2), "node_fps_median": round(statistics.median(node_fps), 2),
                "client_fps_min": round(min(client_fps), 2),
                "slow": slow, "slow_share": slow / count, "load_1min": [round(load_before, 2),
                                                                        round(os.getloadavg()[0], 2)]}
    finally:
        await asyncio.gather(*(c.hangup() for c in clients if c.token and not c.ended), return_exceptions=True)
        await asyncio.gather(*(c.close() for c in clients))
        while door.sessions:  # the next step starts on an empty fleet
            await asyncio.sleep(0.1)


async def bench(args: argparse.Namespace) -> dict:
    import ray

    from charstream.pipeline.fleet.cluster import local_cluster
    from charstream.pipeline.fleet.frontdoor import FrontDoor, join_cluster

    counts = args.sessions
    config = PipelineConfig.from_dict({
        "preset": args.preset,
        "egress": {"port": 0, "max_sessions": max(counts), "sessions_per_client": max(counts),
                   "reservations_per_client": max(counts), "reservations_per_minute": 10 * sum(counts)},
        "fleet": {"max_sessions_per_node": args.max_sessions_per_node, "layout": args.layout}})
    devices = args.nodes
    cluster = None
    if args.cluster is None:
        gpus = session_layout(config.fleet).gpus > 0
        cluster = local_cluster(devices, "GPU" if gpus else config.fleet.cpu_device_resource)
    try:
        join_cluster(args.cluster or cluster.address)
        door = FrontDoor(config, args.source, access_key=KEY)
        url = await door.start()
        try:
            steps = [await run_step(url, door, count, args.seconds) for count in counts]
            nodes = [n["resources"] for n in door.status()["nodes"]]
        finally:
            await door.stop()
            ray.shutdown()  # the driver leaves before its cluster goes
    finally:
        if cluster is not None:
            cluster.shutdown()
    return {"bench": "fleet", "commit": commit_id(), "machine": f"{platform.machine()}, {os.cpu_count()} CPUs",
            "ray": ray.__version__, "cluster": args.cluster or "local", "layout": args.layout, "source": args.source,
            "preset": args.preset, "nodes": devices if cluster is not None else nodes,
            "max_sessions_per_node": args.max_sessions_per_node, "window_s": args.seconds,
            "slow_fps": config.fleet.slow_fps, "steps": steps}


def table(report: dict) -> str:
    rows = [["sessions", "nodes", "node fps min", "node fps median", "client fps min", "<= slow", "load 1m"]]
    for step in report["steps"]:
        if "refused" in step:
            rows.append([str(step["sessions"]), "-", "refused: " + step["refused"], "", "", "", ""])
            continue
        rows.append([str(step["sessions"]), str(step["nodes_used"]), f"{step['node_fps_min']:.2f}",
                     f"{step['node_fps_median']:.2f}", f"{step['client_fps_min']:.2f}",
                     f"{step['slow']} ({100 * step['slow_share']:.0f}%)", f"{step['load_1min'][1]:.2f}"])
    what = "test-card" if report["source"] == "testcard" else report["preset"]
    where = f"nodes {report['nodes']}" if report["cluster"] == "local" else f"cluster {report['cluster']}"
    return (f"fleet load test: {what} sessions, layout {report['layout']}, {where}, {report['window_s']:g} s windows, "
            f"slow = average <= {report['slow_fps']} fps\n" + text_table(rows))


def run(args: argparse.Namespace) -> int:
    report = asyncio.run(bench(args))
    emit_report(report, table(report), args.out, args.json)
    return 0
