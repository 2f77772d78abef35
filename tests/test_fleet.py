"""A fleet on a real local 3-node Ray cluster: ``charstream serve --cluster`` with test-card sessions.

One scenario, since the cluster and the front door take seconds to start: sessions spread by free
capacity, the one past capacity gets 503 in < 1 s, a hangup frees its reservation, killing a node
ends exactly that node's sessions (each page told why, within 5 s: a real Chromium page and an
aiortc one) and a new session then lands elsewhere, a drained node takes no new session while its
running ones play on, and ``charstream fleet status`` and ``/metrics`` report it all.
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

import pytest
from waiting import until

from charstream.pipeline.bench.egress import CHROMIUM, CHROMIUM_ARGS
from charstream.pipeline.fleet.client import FleetClient, FullError
from charstream.pipeline.fleet.cluster import local_cluster
from charstream.pipeline.fleet.commands import request

KEY = "fleet-key"
FLEET_TOML = """
[fleet]
max_sessions_per_node = 2
[egress]
ping_interval_s = 0.5
reservations_per_client = 8  # every page of the test comes from 127.0.0.1
"""


# Outside CI a developer without Chromium gets a skip; under CI (`make test` installs it) a missing
# browser is a failure, never a silent pass.
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(shutil.which(CHROMIUM) is None and not os.environ.get("CI"),
                       reason="Debian chromium not installed (make browser)"),
]


@pytest.fixture(scope="module")
def cluster():
    # CPU devices per node (a session takes 2): the head holds one layout, the first worker two
    # (three by resources, two by the session cap), the second worker one.
    cluster = local_cluster([2, 6, 2])
    yield cluster
    cluster.shutdown()


@pytest.fixture(scope="module")
def front_door(cluster, tmp_path_factory):
    folder = tmp_path_factory.mktemp("fleet")
    (folder / "fleet.toml").write_text(FLEET_TOML)
    log_path = folder / "front_door.log"
    log = open(log_path, "w")
    proc = subprocess.Popen([sys.executable, "-m", "charstream", "serve", "--cluster", cluster.address,
                             "--source", "testcard", "--port", "0", "--key", KEY, "--config",
                             str(folder / "fleet.toml")], stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        match = None
        deadline = time.monotonic() + 60
        while match is None and time.monotonic() < deadline and proc.poll() is None:
            match = re.search(r"open (http://\S+)/\?code=(\S+)", log_path.read_text()) or time.sleep(0.2)
        assert match is not None, f"front door did not start ({proc.poll()}):\n{log_path.read_text()}"
        yield match.group(1), match.group(2), proc, log_path
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


def test_a_fleet_spreads_admits_contains_node_loss_and_drains(cluster, front_door, tmp_path):
    from playwright.async_api import async_playwright

    url, code, proc, log_path = front_door
    head = cluster.head_node.node_id
    nodes = {node.node_id: node for node in cluster.worker_nodes}

    def status() -> dict:
        return request(f"{url}/fleet/status", KEY)

    devices = {n["node_id"]: n["resources"]["charstream_cpu"] for n in status()["nodes"]}
    big, small = sorted(nodes, key=lambda node_id: -devices[node_id])

    def sessions_by_node() -> dict[str, int]:
        return {n["node_id"]: n["sessions"] for n in status()["nodes"]}

    def node_of(session_id: str) -> str:
        return {s["session_id"]: s["node_id"] for s in status()["sessions"]}[session_id]

    async def scenario(browser) -> float:
        clients = [FleetClient(url, KEY) for _ in range(3)]
        extra: list[FleetClient] = []
        try:
            # The page first: the big worker has the most free layouts (2), so it lands there.
            page = await browser.new_page()
            await page.goto(f"{url}/?code={code}&autoconnect=1")
            await page.wait_for_function("window.charstream.framesReported >= 24", timeout=40_000)
            assert sessions_by_node()[big] == 1
            await asyncio.gather(*(c.reserve() for c in clients))
            await asyncio.gather(*(c.connect() for c in clients))
            await asyncio.gather(*(c.media.wait_for_video(24, timeout=30) for c in clients))
            # Spread by free capacity: two on the big worker, one on each other node; none free.
            assert sessions_by_node() == {big: 2, small: 1, head: 1}
            assert all(n["free_layouts"] == 0 for n in status()["nodes"])
            where = {c: node_of(c.session_id) for c in clients}

            full = FleetClient(url, KEY)
            extra.append(full)
            started = time.monotonic()
            with pytest.raises(FullError) as answer:
                await full.reserve()
            assert time.monotonic() - started < 1.0 and answer.value.retry_after == 5

            # A hangup frees its reservation: the head has its layout back.
            [on_head] = [c for c in clients if where[c] == head]
            await on_head.hangup()
            assert await until(lambda: sessions_by_node()[head] == 0, timeout=5)
            assert await until(lambda: on_head.ended is not None, timeout=5)

            # Kill the big worker: exactly its two sessions end, both pages told why, within 5 s.
            [victim] = [c for c in clients if where[c] == big]
            [survivor] = [c for c in clients if where[c] == small]
            frames_before = survivor.media.video_frames
            killed = time.monotonic()
            cluster.remove_node(nodes[big], allow_graceful=False)
            told = "window.charstream.status.startsWith('ended:')"
            assert await until(lambda: victim.ended is not None, timeout=5), "the aiortc page not told within 5 s"
            await page.wait_for_function(told, timeout=max(5_000 - 1e3 * (time.monotonic() - killed), 1))
            told_after = time.monotonic() - killed
            page_status = await page.evaluate("window.charstream.status")
            assert "node" in victim.ended and "lost" in victim.ended, victim.ended
            assert "node" in page_status and "lost" in page_status, page_status
            assert survivor.ended is None
            assert await until(lambda: survivor.media.video_frames >= frames_before + 24, timeout=10)
            states = {n["node_id"]: n["state"] for n in status()["nodes"]}
            assert states[big] == "dead" and sessions_by_node()[big] == 0

            # A new session lands elsewhere: the head's freed layout.
            newcomer = FleetClient(url, KEY)
            extra.append(newcomer)
            await newcomer.reserve()
            await newcomer.connect()
            await newcomer.media.wait_for_video(12, timeout=30)
            assert node_of(newcomer.session_id) == head

            # Drain the head: no new session anywhere (the small worker is full); the head's plays on.
            assert "draining" in fleet_cli("drain", head[:10], "--url", url)
            frames_before = newcomer.media.video_frames
            refused = FleetClient(url, KEY)
            extra.append(refused)
            with pytest.raises(FullError):
                await refused.reserve()
            assert await until(lambda: newcomer.media.video_frames >= frames_before + 24, timeout=10)
            assert newcomer.ended is None

            # Health counts sessions that played >= 5 s.
            assert await until(lambda: status()["health"]["measured"] >= 2, timeout=10)
            return told_after
        finally:
            await asyncio.gather(*(c.close() for c in clients + extra))

    async def main() -> float:
        async with async_playwright() as p:
            browser = await p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
            try:
                return await scenario(browser)
            finally:
                await browser.close()

    told_after = asyncio.run(main())
    print(f"node loss told both pages in {told_after:.2f} s")

    text = fleet_cli("status", "--url", url)
    assert re.search(rf"{head[:12]}\s+draining", text) and re.search(rf"{big[:12]}\s+dead\s+0\s+0", text), text
    assert re.search(r"health: \d+ of \d+ measured sessions averaging <= 23.0 fps", text), text
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        metrics = r.read().decode()
    health = status()["health"]
    assert 'charstream_fleet_nodes{state="dead"} 1.0' in metrics
    assert f"charstream_fleet_sessions_measured {float(health['measured'])}" in metrics
    assert f"charstream_fleet_slow_session_ratio {health['slow'] / health['measured']}" in metrics
    assert 'charstream_fleet_admissions_total{result="full"} 2.0' in metrics

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, log_path.read_text()[-3000:]
