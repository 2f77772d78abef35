"""A fleet on a real local 3-node Ray cluster: ``charstream serve --cluster`` with test-card sessions.

One scenario, since the cluster and the front door take seconds to start: sessions spread by free
capacity, the one past capacity gets 503 in < 1 s, a hangup frees its reservation, killing a node
ends exactly that node's sessions (each page told why, within 5 s) and a new session then lands
elsewhere, a drained node takes no new session while its running ones play on, and
``charstream fleet status`` and ``/metrics`` report it all.
"""

from __future__ import annotations

import asyncio
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from charstream.pipeline.fleet.client import FleetClient, FullError
from charstream.pipeline.fleet.cluster import local_cluster
from charstream.pipeline.fleet.commands import request
from waiting import until

KEY = "fleet-key"
FLEET_TOML = """
[fleet]
max_sessions_per_node = 2
[egress]
ping_interval_s = 0.5
reservations_per_client = 8  # every page of the test comes from 127.0.0.1
"""


@pytest.fixture(scope="module")
def cluster():
    # Devices per node: the head takes 3 layouts by resources but 2 by the session cap, the others 1.
    cluster = local_cluster([6, 2, 2])
    yield cluster
    cluster.shutdown()


@pytest.fixture(scope="module")
def front_door(cluster, tmp_path_factory):
    folder = tmp_path_factory.mktemp("fleet")
    (folder / "fleet.toml").write_text(FLEET_TOML)
    log = open(folder / "front_door.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "charstream", "serve", "--cluster", cluster.address,
                             "--source", "testcard", "--port", "0", "--key", KEY, "--config",
                             str(folder / "fleet.toml")], stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        url = None
        deadline = time.monotonic() + 60
        while url is None and time.monotonic() < deadline and proc.poll() is None:
            match = re.search(r"open (http://\S+)/\?code=", (folder / "front_door.log").read_text())
            url = match.group(1) if match else time.sleep(0.2)
        assert url is not None, f"front door did not start ({proc.poll()}):\n{(folder / 'front_door.log').read_text()}"
        yield url, proc, folder / "front_door.log"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()


def fleet_cli(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "charstream", "fleet", *args, "--key", KEY], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_a_fleet_spreads_admits_contains_node_loss_and_drains(cluster, front_door):
    url, proc, log_path = front_door
    workers = {node.node_id: node for node in cluster.worker_nodes}
    head = cluster.head_node.node_id

    def status() -> dict:
        return request(f"{url}/fleet/status", KEY)

    def sessions_by_node() -> dict[str, int]:
        return {n["node_id"]: n["sessions"] for n in status()["nodes"]}

    async def scenario() -> None:
        clients = [FleetClient(url, KEY) for _ in range(4)]
        extra: list[FleetClient] = []
        try:
            await asyncio.gather(*(c.reserve() for c in clients))
            await asyncio.gather(*(c.connect() for c in clients))
            await asyncio.gather(*(c.media.wait_for_video(24, timeout=30) for c in clients))
            # Spread by free capacity: the head (2 free layouts) takes two, each other node one.
            assert sessions_by_node() == {head: 2, **{w: 1 for w in workers}}
            assert all(n["free_layouts"] == 0 for n in status()["nodes"])
            node_of = {s["session_id"]: s["node_id"] for s in status()["sessions"]}

            full = FleetClient(url, KEY)
            extra.append(full)
            started = time.monotonic()
            with pytest.raises(FullError) as answer:
                await full.reserve()
            assert time.monotonic() - started < 1.0 and answer.value.retry_after == 5

            # A hangup frees its reservation: the head has a free layout again.
            on_head = [c for c in clients if node_of[c.session_id] == head]
            await on_head[0].hangup()
            assert await until(lambda: sessions_by_node()[head] == 1, timeout=5)
            assert await until(lambda: on_head[0].ended is not None, timeout=5)
            running = [c for c in clients if c is not on_head[0]]

            # Kill one worker node: exactly its session ends, its page told why, within 5 s.
            victim_id = next(iter(workers))
            victim = [c for c in running if node_of[c.session_id] == victim_id]
            survivors = [c for c in running if c not in victim]
            frames_before = [len(c.media.video) for c in survivors]
            killed = time.monotonic()
            cluster.remove_node(workers[victim_id], allow_graceful=False)
            assert await until(lambda: all(c.ended is not None for c in victim), timeout=5), \
                f"{len(victim)} pages not told within 5 s"
            told_after = time.monotonic() - killed
            assert all("node" in c.ended and "lost" in c.ended for c in victim), [c.ended for c in victim]
            assert all(c.ended is None for c in survivors)
            assert await until(lambda: all(len(c.media.video) >= n + 24 for c, n in
                                           zip(survivors, frames_before, strict=True)), timeout=10)
            states = {n["node_id"]: n["state"] for n in status()["nodes"]}
            assert states[victim_id] == "dead" and sessions_by_node()[victim_id] == 0

            # A new session lands elsewhere: the head's freed layout.
            newcomer = FleetClient(url, KEY)
            extra.append(newcomer)
            await newcomer.reserve()
            await newcomer.connect()
            await newcomer.media.wait_for_video(12, timeout=30)
            assert {s["session_id"]: s["node_id"] for s in status()["sessions"]}[newcomer.session_id] == head

            # Drain the head: no new session anywhere (the other worker is full), the head's play on.
            drained = fleet_cli("drain", head[:10], "--url", url)
            assert "draining" in drained
            on_head_now = [c for c in survivors + [newcomer] if c.session_id in
                           {s["session_id"] for s in status()["sessions"] if s["node_id"] == head}]
            frames_before = [len(c.media.video) for c in on_head_now]
            refused = FleetClient(url, KEY)
            extra.append(refused)
            with pytest.raises(FullError):
                await refused.reserve()
            assert await until(lambda: all(len(c.media.video) >= n + 24 for c, n in
                                           zip(on_head_now, frames_before, strict=True)), timeout=10)
            assert all(c.ended is None for c in on_head_now)

            # Health counts sessions that played >= 5 s (the ones from the start have by now).
            assert await until(lambda: status()["health"]["measured"] >= 3, timeout=10)
            print(f"node loss told the page in {told_after:.2f} s")
        finally:
            await asyncio.gather(*(c.close() for c in clients + extra))

    asyncio.run(scenario())

    text = fleet_cli("status", "--url", url)
    assert re.search(rf"{head[:12]}\s+draining", text) and re.search(r"\s+dead\s+0\s+0", text)
    assert re.search(r"health: \d+ of \d+ measured sessions averaging <= 23.0 fps", text), text
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    health = status()["health"]
    assert 'charstream_fleet_nodes{state="dead"} 1.0' in metrics
    assert f"charstream_fleet_sessions_measured {float(health['measured'])}" in metrics
    assert f"charstream_fleet_slow_session_ratio {health['slow'] / health['measured']}" in metrics
    assert 'charstream_fleet_admissions_total{result="full"} 2.0' in metrics

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, Path(log_path).read_text()[-3000:]
