"""``charstream serve --source testcard`` as a real process, and session reservations that expire."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import time

import aiohttp
import anyio

from charstream.pipeline.config import PipelineConfig
from charstream.pipeline.runtime.runner import Node
from charstream.pipeline.session import session_factory
from charstream.pipeline.web.client import EgressClient
from charstream.pipeline.web.server import EgressServer
from charstream.stages.config import EgressConfig
from charstream.stages.egress.testcard import CardSource


def quiet_card():
    """Test-card sessions whose card does not listen (the mic queue fills and drops)."""
    return session_factory(PipelineConfig(), testcard=Node("card", CardSource, {"listen": False}))


def test_serve_command_streams_the_test_card_and_stops_cleanly(tmp_path):
    stderr = (tmp_path / "stderr").open("w")
    proc = subprocess.Popen([sys.executable, "-m", "charstream", "serve", "--source", "testcard", "--port", "0",
                             "--key", "secret"], stdout=subprocess.PIPE, stderr=stderr, text=True)
    try:
        url = None
        deadline = time.monotonic() + 30
        while url is None and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, f"serve exited early with {proc.poll()}"
            match = re.search(r"open (http://\S+)/\?code=(\S+)", line)
            url, code = match.groups() if match else (None, None)
        assert url is not None and "secret" not in line  # the key itself is never printed in a link

        async def client_session() -> tuple[int, int, int]:
            async with aiohttp.ClientSession() as http:
                async with http.get(url + "/") as r:
                    page = r.status, "charstream" in await r.text()
                async with http.post(url + "/code", json={"code": code}) as r:
                    key = (await r.json())["key"]
                async with http.post(url + "/code", json={"code": code}) as r:
                    reused = r.status
                async with http.post(url + "/session", headers={"X-Charstream-Key": key}) as r:
                    token = (await r.json())["token"]
            client = EgressClient(keep_images=True)
            await client.connect(url, token)
            await client.wait_for_video(24, timeout=30)
            frames = client.video_frames
            image = client.video[-1].image
            await client.close()
            return page, key, reused, frames, image.shape

        page, key, reused, frames, shape = asyncio.run(client_session())
        assert page == (200, True) and key == "secret" and reused == 403
        assert frames >= 24 and shape == (128, 128, 3)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        stderr.close()
    # Logging is configured: JSON lines on stderr (structlog's default would print text to stdout).
    events = [json.loads(line)["event"] for line in (tmp_path / "stderr").read_text().splitlines() if line.strip()]
    assert "egress_listening" in events and "session_closed" in events


def test_serve_keeps_serving_when_nobody_reads_its_stderr():
    # Each refused Host logs a warning: 3,000 of them are ~700 kB, ten times a pipe's buffer.
    proc = subprocess.Popen([sys.executable, "-m", "charstream", "serve", "--source", "testcard", "--port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        match = None
        while match is None:
            line = proc.stdout.readline()
            assert line, f"serve exited early with {proc.poll()}"
            match = re.search(r"open (http://\S+)/\?code=", line)

        async def flood() -> tuple[list[int], float]:
            async with aiohttp.ClientSession() as http:
                statuses = []
                for _ in range(3000):
                    async with http.get(match.group(1) + "/", headers={"Host": "evil.example"}) as r:
                        statuses.append(r.status)
                started = time.monotonic()
                async with http.get(match.group(1) + "/") as r:
                    statuses.append(r.status)
                return statuses, time.monotonic() - started

        statuses, took = asyncio.run(asyncio.wait_for(flood(), 60))
        assert statuses[:-1] == [403] * 3000 and statuses[-1] == 200 and took < 1.0
    finally:
        proc.kill()
        proc.wait()


def test_a_reservation_without_an_offer_is_released():
    async def main():
        server = EgressServer(EgressConfig(port=0, offer_timeout_s=0.3, max_sessions=1), quiet_card())
        await server.start()
        server.create_session()
        try:
            server.create_session()
            full = False
        except Exception as e:  # the one slot is taken
            full = "server full" in str(e)
        await asyncio.sleep(0.6)
        left = dict(server.sessions)
        server.create_session()  # the slot is free again
        await server.stop()
        return full, left

    full, left = asyncio.run(main())
    assert full and left == {}


def test_when_the_pipeline_ends_the_page_is_told_and_the_session_released():
    async def main():
        factory = quiet_card()
        server = EgressServer(EgressConfig(port=0, ping_interval_s=0.2), factory)
        url = await server.start()
        session_id, token = server.create_session()
        client = EgressClient()
        await client.connect(url, token)
        await client.wait_for_video(6, timeout=30)
        await factory.sessions[session_id].stop("pipeline gone")  # the session's pipeline stops (or fails)
        for _ in range(50):
            if session_id not in server.sessions and session_id not in factory.sessions:
                break
            await asyncio.sleep(0.1)
        result = client.ended, dict(server.sessions), dict(factory.sessions)
        await client.close()
        await server.stop()
        return result

    ended, left, cards = asyncio.run(main())
    assert ended == "stop: pipeline gone" and left == {} and cards == {}  # the page is told why


class FailingCard(CardSource):
    """A card that fails after a few chunks, as a broken model stage would."""

    async def run(self, ctx) -> None:
        with anyio.move_on_after(0.5):
            await super().run(ctx)
        raise RuntimeError("the card broke")


def test_a_failed_stage_ends_its_session_and_the_page_is_told_which_and_why():
    async def main():
        factory = session_factory(PipelineConfig(), testcard=Node("card", FailingCard, {"listen": False}))
        server = EgressServer(EgressConfig(port=0, ping_interval_s=0.2), factory)
        url = await server.start()
        session_id, token = server.create_session()
        client = EgressClient()
        await client.connect(url, token)
        ended_in = time.monotonic()
        for _ in range(100):
            if client.ended and session_id not in server.sessions:
                break
            await asyncio.sleep(0.05)
        ended_in = time.monotonic() - ended_in
        result = client.ended, dict(server.sessions), dict(factory.sessions)
        await client.close()
        await server.stop()
        return result, ended_in

    (ended, left, sessions), ended_in = asyncio.run(main())
    assert ended is not None and "stage 'card' failed" in ended and "the card broke" in ended
    assert left == {} and sessions == {} and ended_in < 3.0
